//! CPython support in userspace: recognising an interpreter from its ELF file, the struct
//! layouts per version (data, not code), reading process memory, symbolizing code objects and
//! a userspace frame walker.
//!
//! BPF will walk frames at sample time and emit (code object address, instruction) per Python
//! frame; everything here is what turns that into names and lines, and what proves the
//! layouts on real interpreters without BPF.
pub mod code;
pub mod debug_offsets;
pub mod detect;
pub mod layout;
pub mod memory;
pub mod py_spy;
pub mod walk;

pub use code::{CodeCache, CodeError, PyFrameInfo, symbolize_code};
pub use detect::{DetectError, PythonProcess, detect_python};
pub use layout::PyLayout;
pub use memory::{ProcMemory, ProcessMemory};
pub use walk::{PyThreadStack, walk_process};

#[cfg(test)]
mod tests;
