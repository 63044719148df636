#!/bin/sh
# Dev tool: prints the CPython struct offsets that `layout.rs` stores as data, read from the
# DWARF of pyenv's shared builds with gdb. Run it after adding a version and copy the numbers
# into the table (tests never need gdb). Usage: gen_layouts.sh [PYENV_ROOT]
# A field missing in a version prints "n/a".
set -u
root=${1:-${PYENV_ROOT:-$HOME/.pyenv}}

offset() { # lib, C expression of a field → its offset
    out=$(gdb -batch -ex "print (long)&(($2)" "$1" 2>/dev/null | sed -n 's/^\$1 = //p')
    echo "${out:-n/a}"
}
size() {
    out=$(gdb -batch -ex "print sizeof($2)" "$1" 2>/dev/null | sed -n 's/^\$1 = //p')
    echo "${out:-n/a}"
}

for dir in "$root"/versions/3.*; do
    version=$(basename "$dir")
    minor=$(echo "$version" | cut -d. -f1-2)
    lib=$(ls "$dir"/lib/libpython"$minor".so.1.0 2>/dev/null) || continue
    echo "== $version ($lib)"
    for field in \
        "(_PyRuntimeState*)0)->interpreters.head" \
        "(_PyRuntimeState*)0)->gilstate.tstate_current" \
        "(_PyRuntimeState*)0)->gilstate.autoTSSkey" \
        "(_PyRuntimeState*)0)->autoTSSkey" \
        "(PyInterpreterState*)0)->next" \
        "(PyInterpreterState*)0)->tstate_head" \
        "(PyInterpreterState*)0)->threads.head" \
        "(PyThreadState*)0)->next" \
        "(PyThreadState*)0)->frame" \
        "(PyThreadState*)0)->cframe" \
        "(PyThreadState*)0)->current_frame" \
        "(PyThreadState*)0)->thread_id" \
        "(PyThreadState*)0)->native_thread_id" \
        "(_PyCFrame*)0)->current_frame" \
        "(PyFrameObject*)0)->f_back" \
        "(PyFrameObject*)0)->f_code" \
        "(PyFrameObject*)0)->f_lasti" \
        "(_PyInterpreterFrame*)0)->f_code" \
        "(_PyInterpreterFrame*)0)->f_executable" \
        "(_PyInterpreterFrame*)0)->previous" \
        "(_PyInterpreterFrame*)0)->prev_instr" \
        "(_PyInterpreterFrame*)0)->instr_ptr" \
        "(_PyInterpreterFrame*)0)->is_entry" \
        "(_PyInterpreterFrame*)0)->owner" \
        "(PyCodeObject*)0)->co_firstlineno" \
        "(PyCodeObject*)0)->co_filename" \
        "(PyCodeObject*)0)->co_name" \
        "(PyCodeObject*)0)->co_qualname" \
        "(PyCodeObject*)0)->co_lnotab" \
        "(PyCodeObject*)0)->co_linetable" \
        "(PyCodeObject*)0)->co_code_adaptive" \
        "(PyASCIIObject*)0)->state" \
        "(PyBytesObject*)0)->ob_sval"; do
        printf '%-48s %s\n' "$field" "$(offset "$lib" "$field")"
    done
    for type in PyASCIIObject PyCompactUnicodeObject; do
        printf '%-48s %s\n' "sizeof($type)" "$(size "$lib" "$type")"
    done
done
