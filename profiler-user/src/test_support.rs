//! Helpers shared by unit tests of several modules.

/// Resident bytes of this process's mapping that starts at `address`, from /proc/self/smaps.
pub fn resident_bytes_of_mapping(address: *const u8) -> u64 {
    smaps_field_of_mapping(address, "Rss:")
        .trim()
        .strip_suffix("kB")
        .and_then(|rss| rss.trim().parse::<u64>().ok())
        .expect("Rss line")
        * 1024
}

/// The `VmFlags` of the mapping that starts at `address` (/proc/self/smaps: `rd`, `mr`, `rr`
/// for random access advised, ...).
pub fn flags_of_mapping(address: *const u8) -> Vec<String> {
    smaps_field_of_mapping(address, "VmFlags:")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

fn smaps_field_of_mapping(address: *const u8, field: &str) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let start = format!("{:x}-", address as usize);
    let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&start));
    lines.next().expect("the mapping is listed");
    lines
        .find_map(|line| line.strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} line"))
        .to_owned()
}
