use blazesym::symbolize::{
    self as bz, Input,
    source::{Elf, Source},
};
fn rss() -> (u64, u64) {
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
    (f("RssAnon:"), f("RssFile:"))
}
fn main() {
    let path = std::env::args().nth(1).unwrap();
    let before = rss();
    let s = bz::Symbolizer::builder()
        .enable_demangling(false)
        .enable_code_info(false)
        .enable_inlined_fns(false)
        .build();
    let mut elf = Elf::new(&path);
    elf.debug_syms = false;
    let src = Source::Elf(elf);
    let t = std::time::Instant::now();
    let r = s.symbolize_single(&src, Input::FileOffset(0x6f5d3eb));
    println!(
        "{:?} in {:?}",
        r.map(|x| match x {
            bz::Symbolized::Sym(s) => s.name.to_string(),
            _ => "unknown".into(),
        }),
        t.elapsed()
    );
    let t = std::time::Instant::now();
    for off in (0x100000..0x8000000u64).step_by(0x10000) {
        let _ = s.symbolize_single(&src, Input::FileOffset(off));
    }
    println!("1800 more in {:?}", t.elapsed());
    let after = rss();
    println!(
        "anon {} -> {} MiB, file {} -> {} MiB",
        before.0, after.0, before.1, after.1
    );
}
