fn main() {
    for path in std::env::args().skip(1) {
        let data = std::fs::read(&path).unwrap();
        let t = std::time::Instant::now();
        match profiler::unwinding::tables::build_table(&data) {
            Ok(table) => {
                let s = table.stats();
                println!(
                    "{path}: rows={} reliable={} sig={} code={} calls={} first_break={:#x} unsup_expr={} unsup_reg={} {:?}",
                    table.row_count(),
                    table.frame_pointers_reliable(),
                    s.signal_fdes,
                    s.call_sites.code_bytes,
                    s.call_sites.call_sites,
                    s.call_sites.first_frame_breaking_call,
                    s.unsupported_cfa_expressions,
                    s.unsupported_cfa_registers,
                    t.elapsed()
                );
            }
            Err(e) => println!("{path}: error {e}"),
        }
    }
}
