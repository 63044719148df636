//! Helpers shared by unit tests of several modules.

/// Resident bytes of this process's mapping that starts at `address`, from /proc/self/smaps.
pub fn resident_bytes_of_mapping(address: *const u8) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let start = format!("{:x}-", address as usize);
    let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&start));
    lines.next().expect("the mapping is listed");
    lines
        .find_map(|line| line.strip_prefix("Rss:"))
        .and_then(|rss| rss.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .expect("Rss line")
        * 1024
}
