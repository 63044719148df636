fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let f = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .parse::<u64>()
            .unwrap()
            / 1024
    };
    f("VmHWM:")
}
fn main() {
    for path in std::env::args().skip(1) {
        let file = std::fs::File::open(&path).unwrap();
        let data = unsafe { memmap2::Mmap::map(&file).unwrap() };
        let before = rss();
        let t = std::time::Instant::now();
        let table = profiler::unwinding::tables::build_table(&data).unwrap();
        let built = rss();
        let s = table.stats();
        let _ = table.paged();
        let paged = rss();
        println!(
            "{path}: rows={} before_merge={} fdes={} reliable={} {:?} hwm MiB: start {before} built {built} paged {paged}",
            table.row_count(),
            s.rows_before_merge,
            s.fdes,
            table.frame_pointers_reliable(),
            t.elapsed()
        );
    }
}
