//! CPython support in userspace: recognising an interpreter from its ELF file, the struct
//! layouts per version (data, not code), reading process memory, symbolizing code objects and
//! a userspace frame walker.
//!
//! BPF walks frames at sample time and emits (code object address, instruction, first line)
//! per Python frame; `tracker` registers interpreters with BPF and splices those frames into
//! native stacks, and the rest turns them into names and lines (and proves the layouts on real
//! interpreters without BPF).
pub mod code;
pub mod debug_offsets;
pub mod detect;
pub mod layout;
pub mod memory;
pub mod py_spy;
pub mod tracker;
pub mod walk;

pub use code::{CodeCache, CodeError, PyFrameInfo, symbolize_code};
pub use detect::{DetectError, PythonProcess, detect_python};
pub use layout::PyLayout;
pub use memory::{ProcMemory, ProcessMemory};
pub use tracker::{PythonRuntime, PythonStats, PythonTracker};
pub use walk::{PyThreadStack, walk_process};

#[cfg(test)]
mod tests;
