//! Brendan Gregg's folded-stack format (`root;caller;leaf count`), as read by flamegraph.pl,
//! inferno and speedscope.
use std::{collections::BTreeMap, io};

use crate::model::{FrameKind, Profile};

/// Writes one line per distinct stack, root first, sorted by stack text. Stacks that differ only
/// by sample labels are summed; inlined functions each get their own element.
pub fn write_folded(profile: &Profile, out: &mut impl io::Write) -> io::Result<()> {
    let mut counts_by_stack: BTreeMap<String, u64> = BTreeMap::new();
    for sample in &profile.samples {
        let mut stack_text = String::new();
        // The stack is innermost first; folded wants the root first.
        let frames = sample
            .stack
            .iter()
            .rev()
            .filter_map(|&index| profile.frames.get(usize::try_from(index).ok()?));
        for frame in frames {
            // Lines are innermost first too: the outermost (caller) comes first in folded text.
            for line in frame.lines.iter().rev() {
                if !stack_text.is_empty() {
                    stack_text.push(';');
                }
                push_sanitized(&mut stack_text, &line.function);
                // Python frames read `qualname (file:line)`, as py-spy prints them.
                if frame.kind == FrameKind::Python
                    && let Some(file) = &line.file
                {
                    stack_text.push_str(" (");
                    push_sanitized(&mut stack_text, file);
                    stack_text.push_str(&format!(":{})", line.line));
                }
            }
        }
        if stack_text.is_empty() {
            continue;
        }
        let total = counts_by_stack.entry(stack_text).or_default();
        *total = total.saturating_add(sample.count);
    }
    for (stack_text, count) in counts_by_stack {
        if count > 0 {
            writeln!(out, "{stack_text} {count}")?;
        }
    }
    Ok(())
}

/// ';' separates frames and '\n' separates stacks, so neither may appear inside a name; an empty
/// name would leave an empty element that some readers reject.
fn push_sanitized(out: &mut String, name: &str) {
    if name.is_empty() {
        out.push_str("[unknown]");
        return;
    }
    out.extend(name.chars().map(|c| match c {
        ';' => ':',
        '\n' | '\r' => ' ',
        other => other,
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::test_fixture::{self, *};
    use crate::model::ProfileSample;

    fn folded_text(profile: &Profile) -> String {
        let mut out = Vec::new();
        write_folded(profile, &mut out).expect("write into memory");
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn stacks_are_root_first_summed_across_labels_and_sorted() {
        assert_eq!(
            folded_text(&test_fixture::profile()),
            "myapp;main;libfoo.so+0x1234;do_syscall_64 3\n\
             myapp;main;outer_fn;inner_helper 7\n\
             myapp;main;weird:name x 1\n"
        );
    }

    #[test]
    fn out_of_range_indexes_and_empty_stacks_are_skipped() {
        let mut profile = test_fixture::profile();
        profile.samples = vec![
            ProfileSample {
                stack: vec![u32::MAX, KERNEL, ROOT],
                count: 4,
                more_values: Vec::new(),
                labels: Vec::new(),
            },
            ProfileSample {
                stack: vec![u32::MAX],
                count: 9,
                more_values: Vec::new(),
                labels: Vec::new(),
            },
            ProfileSample {
                stack: Vec::new(),
                count: 9,
                more_values: Vec::new(),
                labels: Vec::new(),
            },
        ];
        assert_eq!(folded_text(&profile), "myapp;do_syscall_64 4\n");
    }

    #[test]
    fn empty_profile_writes_nothing() {
        assert_eq!(folded_text(&Profile::default()), "");
    }

    /// Python frames read `qualname (file:line)` between native frames (which keep their bare
    /// names even with a file); an unreadable code object has no file and stays a bare name.
    #[test]
    fn python_frames_show_qualname_file_and_line() {
        use crate::model::SymbolizedFrame;
        let mut profile = test_fixture::profile();
        let python = |name: &str, file: Option<&str>, line_number: u32| SymbolizedFrame {
            kind: FrameKind::Python,
            address: 0x7f00_1000_0000 + u64::from(line_number),
            mapping: None,
            lines: vec![line(name, None, file, line_number)],
            unsymbolized: file.is_none(),
        };
        let first = profile.frames.len() as u32;
        profile.frames.extend([
            python("Worker.spin", Some("/app/work;er.py"), 31),
            python("<module>", Some("/app/main.py"), 7),
            python("[unknown python]", None, 0),
        ]);
        let (spin, module, unknown) = (first, first + 1, first + 2);
        profile.samples = vec![
            ProfileSample {
                // Innermost first: spin, called through native main, from the module.
                stack: vec![spin, MAIN, module, ROOT],
                count: 5,
                more_values: Vec::new(),
                labels: Vec::new(),
            },
            ProfileSample {
                stack: vec![unknown, ROOT],
                count: 2,
                more_values: Vec::new(),
                labels: Vec::new(),
            },
        ];
        assert_eq!(
            folded_text(&profile),
            "myapp;<module> (/app/main.py:7);main;Worker.spin (/app/work:er.py:31) 5\n\
             myapp;[unknown python] 2\n"
        );
    }

    #[test]
    fn separators_and_empty_names_are_sanitized() {
        let mut text = String::new();
        push_sanitized(&mut text, "a;b\r\nc");
        push_sanitized(&mut text, "");
        assert_eq!(text, "a:b  c[unknown]");
    }
}
