use core::{ffi::c_void, ptr};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_NO_WAKEUP, bpf_perf_event_data},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_probe_read_kernel,
        generated::{
            bpf_get_current_cgroup_id, bpf_get_current_task, bpf_get_stack,
            bpf_probe_read_kernel_str, bpf_probe_read_user as bpf_probe_read_user_raw,
        },
    },
    macros::{map, perf_event, raw_tracepoint},
    maps::RingBuf,
    programs::{PerfEventContext, RawTracePointContext},
};
use profiler_common::{
    CGROUP_MOVE_PATH_BYTES, CgroupMoveEvent, EVENT_CGROUP_MIGRATION, EVENT_CGROUPS_CHANGED,
    EVENT_PROCESS_EXEC, EVENT_PROCESS_EXIT, EVENT_PROCESS_FORK, EVENTS_RING_BYTES, EXEC_ARGS_BYTES,
    EXEC_ENV_BYTES, EXEC_FILENAME_BYTES, ExecDetails, ExecEvent, ForkDetails, ForkEvent,
    IdentityOffsets, MAX_KERNEL_FRAMES, ProcessEvent, SAMPLE_IN_CUDA_SYNC, SAMPLE_IN_USER_MODE,
    SAMPLE_KERNEL_STACK_ERROR, SAMPLE_KERNEL_TRUNCATED, SAMPLES_RING_BYTES, STAT_EVENTS_LOST,
    STAT_FILTERED, STAT_IDLE, STAT_KERNEL_STACK_ERROR, STAT_KERNEL_TRUNCATED, STAT_RINGBUF_FULL,
    STAT_RINGBUF_PENDING_BYTES, STAT_SAMPLES_SEEN, STAT_SAMPLES_SENT, SamplerConfig,
};

use crate::{
    cuda, python,
    shared::{CONFIG, PID_FILTER, SLOT_SAMPLER, STATS, count, output_sample, scratch_sample},
    user_stack,
};

#[map(name = "SAMPLES")]
static SAMPLES: RingBuf = RingBuf::with_byte_size(SAMPLES_RING_BYTES, 0);

#[map(name = "EVENTS")]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_RING_BYTES, 0);

#[perf_event]
pub fn sample_cpu(ctx: PerfEventContext) -> u32 {
    count(STAT_SAMPLES_SEEN);
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    let config = CONFIG.get(0).copied().unwrap_or_default();

    if tgid == 0 && config.keep_idle == 0 {
        count(STAT_IDLE);
        return 0;
    }
    if config.filter_pids != 0 && unsafe { PID_FILTER.get(&tgid) }.is_none() {
        count(STAT_FILTERED);
        return 0;
    }
    let Some(sample) = scratch_sample(SLOT_SAMPLER) else {
        return 0;
    };
    // SAFETY: `sample` is this CPU's scratch slot; perf-event programs do not nest on a CPU.
    unsafe {
        let header = &mut (*sample).header;
        header.ktime_ns = bpf_ktime_get_ns();
        header.pid = tgid;
        header.tid = tid;
        header.cpu = bpf_get_smp_processor_id();
        header.python_frames = 0;
        header.comm = bpf_get_current_comm().unwrap_or([0; 16]);
        let mut flags = 0;

        let data = ctx.as_ptr() as *const bpf_perf_event_data;
        // Ring 3 in the saved code segment selector means the CPU was running user code.
        let in_user_mode = (*data).regs.cs & 3 == 3;
        if in_user_mode {
            flags |= SAMPLE_IN_USER_MODE;
        }
        let cuda_thread = if config.cuda_probes != 0 {
            cuda::thread(tid)
        } else {
            None
        };
        if let Some(thread) = cuda_thread
            && (*thread).in_sync != 0
        {
            flags |= SAMPLE_IN_CUDA_SYNC;
        }
        header.flags = flags;

        let regs = if in_user_mode {
            Some(user_stack::Registers {
                rip: (*data).regs.rip,
                rsp: (*data).regs.rsp,
                rbp: (*data).regs.rbp,
            })
        } else {
            user_stack::task_user_registers()
        };
        // Stack copies only while the ring is less than half full: under pressure the small
        // records go on, the large ones are shed.
        let copy_allowed =
            SAMPLES.query(BPF_RB_AVAIL_DATA as u64) < (SAMPLES_RING_BYTES / 2) as u64;
        take_stacks(
            ctx.as_ptr(),
            SLOT_SAMPLER,
            sample,
            &config,
            in_user_mode,
            regs,
            copy_allowed,
            cuda_thread,
        );

        if !output_sample(&SAMPLES, ptr::null::<u8>(), 0, sample) {
            count(STAT_RINGBUF_FULL);
            return 0;
        }
    }
    count(STAT_SAMPLES_SENT);
    if let Some(stats) = STATS.get_ptr_mut(0) {
        unsafe {
            (*stats).counters[STAT_RINGBUF_PENDING_BYTES as usize] =
                SAMPLES.query(BPF_RB_AVAIL_DATA as u64)
        };
    }
    0
}

/// Fills `sample` (this CPU's scratch sample for `slot`, its header's pid, tid and flags set)
/// with the current task's stacks: the kernel stack (unless the context is user mode), the
/// native user stack from `regs`, and the Python frames. Shared by the CPU sampler and the
/// off-CPU program, so a blocked thread's stack is taken exactly as a sampled one's.
///
/// # Safety
/// `ctx` must be the program's context and `sample` the scratch sample of `slot`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn take_stacks(
    ctx: *mut c_void,
    slot: u32,
    sample: *mut profiler_common::RawSample,
    config: &SamplerConfig,
    in_user_mode: bool,
    regs: Option<user_stack::Registers>,
    copy_allowed: bool,
    cuda_thread: Option<*const profiler_common::CudaThread>,
) {
    unsafe {
        let header = &mut (*sample).header;
        let mut flags = header.flags;
        // A sample taken in user mode has no kernel stack: skip the helper's callchain set-up.
        header.kernel_frames = 0;
        if !in_user_mode {
            let kernel_bytes = bpf_get_stack(
                ctx,
                (*sample).kernel_ips.as_mut_ptr().cast(),
                (MAX_KERNEL_FRAMES * 8) as u32,
                0,
            );
            if kernel_bytes < 0 {
                flags |= SAMPLE_KERNEL_STACK_ERROR;
                count(STAT_KERNEL_STACK_ERROR);
            } else {
                header.kernel_frames = (kernel_bytes / 8) as u16;
                if header.kernel_frames as usize == MAX_KERNEL_FRAMES {
                    flags |= SAMPLE_KERNEL_TRUNCATED;
                    count(STAT_KERNEL_TRUNCATED);
                }
            }
        }
        header.flags = flags;
        // SAFETY: a map value; a torn read only misplaces one frame of one sample.
        let returns = cuda_thread.filter(|thread| (**thread).depth > 0);
        let (tgid, tid) = (header.pid, header.tid);
        user_stack::collect(slot, tgid, regs, true, copy_allowed, returns, sample);
        python::collect(slot, tgid, tid, config.task_fsbase_offset, sample);
    }
}

/// Tells the agent a process is gone so it drops the process's mappings at once (a reused pid
/// must never be unwound with the previous process's tables). Fires for every exiting thread:
/// the thread's CUDA state goes with it (so a reused tid starts clean), and the process is
/// reported when its last thread exits. A leader that exits while other threads run (e.g.
/// `pthread_exit` in `main`) does not end the process.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn process_exit(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    let config = CONFIG.get(0).copied().unwrap_or_default();
    // Threads have CUDA state only once the CUDA probes exist.
    if config.cuda_probes != 0 {
        cuda::forget_thread(tid);
    }
    if tgid == 0 {
        return 0;
    }
    let group_dead = match live_threads(&config) {
        Some(live) => live == 0,
        // Without the offsets, the leader's exit stands for the process's.
        None => tgid == tid,
    };
    if group_dead {
        send_event(EVENT_PROCESS_EXIT, tgid);
    }
    0
}

/// `current->signal->live`: threads of the process that have not begun exiting. do_exit
/// decrements it before this tracepoint, so it is 0 at the last thread's exit.
#[inline(always)]
fn live_threads(config: &SamplerConfig) -> Option<i32> {
    if config.task_signal_offset == 0 {
        return None;
    }
    // SAFETY: reads of kernel memory through the probe-read helper, which fails cleanly.
    unsafe {
        let task = bpf_get_current_task();
        let signal: u64 =
            bpf_probe_read_kernel((task + config.task_signal_offset as u64) as *const u64).ok()?;
        if signal == 0 {
            return None;
        }
        bpf_probe_read_kernel((signal + config.signal_live_offset as u64) as *const i32).ok()
    }
}

/// Tells the agent a process exec'ed: its old mappings (and their tables) no longer apply. The
/// event says who the process became (path, arguments, cgroup, executable and its code range),
/// read now, so a process that exits before the agent looks at /proc keeps its identity.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(ctx: RawTracePointContext) -> i32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let config = CONFIG.get(0).copied().unwrap_or_default();
    let Some(mut entry) = EVENTS.reserve::<ExecEvent>(0) else {
        count(STAT_EVENTS_LOST);
        return 0;
    };
    // SAFETY: the reserved record is ours until submitted; every field is written below
    // (the strings up to the lengths recorded); kernel and user memory is read with the
    // probe-read helpers, which fail cleanly.
    unsafe {
        let event = entry.as_mut_ptr();
        (*event).header = ProcessEvent {
            ktime_ns: bpf_ktime_get_ns(),
            kind: EVENT_PROCESS_EXEC,
            pid: tgid,
        };
        let details = &raw mut (*event).details;
        (*details).cgroup_id = bpf_get_current_cgroup_id();
        (*details).exe_ino = 0;
        (*details).exe_dev = 0;
        (*details).filename_len = 0;
        (*details).args_len = 0;
        (*details).env_size = 0;
        (*details).env_len = 0;
        (*details)._pad = 0;
        (*details).start_code = 0;
        (*details).end_code = 0;
        (*details).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        let offsets = config.identity;
        if offsets.complete != 0 {
            // sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
            let bprm = *(ctx.as_ptr() as *const u64).add(2);
            read_exec_details(details, bprm, &offsets);
        }
    }
    entry.submit(BPF_RB_NO_WAKEUP as u64);
    0
}

#[inline(always)]
unsafe fn read_kernel_u64(address: u64) -> u64 {
    unsafe { bpf_probe_read_kernel(address as *const u64).unwrap_or(0) }
}

#[inline(always)]
unsafe fn read_exec_details(details: *mut ExecDetails, bprm: u64, offsets: &IdentityOffsets) {
    unsafe {
        let filename = read_kernel_u64(bprm + offsets.binprm_filename as u64);
        if filename != 0 {
            let copied = bpf_probe_read_kernel_str(
                (&raw mut (*details).filename).cast(),
                EXEC_FILENAME_BYTES as u32,
                filename as *const c_void,
            );
            if copied > 0 {
                (*details).filename_len = copied as u16;
            }
        }
        let file = read_kernel_u64(bprm + offsets.binprm_file as u64);
        if file != 0 {
            let inode = read_kernel_u64(file + offsets.file_inode as u64);
            if inode != 0 {
                (*details).exe_ino = read_kernel_u64(inode + offsets.inode_ino as u64);
                let sb = read_kernel_u64(inode + offsets.inode_sb as u64);
                if sb != 0 {
                    (*details).exe_dev =
                        bpf_probe_read_kernel((sb + offsets.sb_dev as u64) as *const u32)
                            .unwrap_or(0);
                }
            }
        }
        let mm = read_kernel_u64(bpf_get_current_task() + offsets.task_mm as u64);
        if mm == 0 {
            return;
        }
        (*details).start_code = read_kernel_u64(mm + offsets.mm_start_code as u64);
        (*details).end_code = read_kernel_u64(mm + offsets.mm_end_code as u64);
        let arg_start = read_kernel_u64(mm + offsets.mm_arg_start as u64);
        let arg_end = read_kernel_u64(mm + offsets.mm_arg_end as u64);
        let mut length = arg_end.wrapping_sub(arg_start);
        if arg_start == 0 || length == 0 || length > (1 << 30) {
            return;
        }
        if length > EXEC_ARGS_BYTES as u64 {
            length = EXEC_ARGS_BYTES as u64;
        }
        // The new program's argument strings, in its own (now current) address space.
        if bpf_probe_read_user_raw(
            (&raw mut (*details).args).cast(),
            length as u32,
            arg_start as *const c_void,
        ) == 0
        {
            (*details).args_len = length as u16;
        }
        read_exec_environment(details, mm, offsets);
    }
}

/// The new program's environment strings, whole or not at all: the agent takes the labels'
/// variables from them, and a part would not show that one is absent.
#[inline(always)]
unsafe fn read_exec_environment(details: *mut ExecDetails, mm: u64, offsets: &IdentityOffsets) {
    unsafe {
        let env_start = read_kernel_u64(mm + offsets.mm_env_start as u64);
        let env_end = read_kernel_u64(mm + offsets.mm_env_end as u64);
        let size = env_end.wrapping_sub(env_start);
        if env_start == 0 || size == 0 || size > (1 << 30) {
            return;
        }
        (*details).env_size = size as u32;
        if size > EXEC_ENV_BYTES as u64 {
            return;
        }
        if bpf_probe_read_user_raw(
            (&raw mut (*details).env).cast(),
            size as u32,
            env_start as *const c_void,
        ) == 0
        {
            (*details).env_len = size as u16;
        }
    }
}

/// Tells the agent a new process was forked (a thread is not a process): a child that exits
/// without exec'ing is its parent's program, whose snapshot and service it takes.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn process_fork(ctx: RawTracePointContext) -> i32 {
    let config = CONFIG.get(0).copied().unwrap_or_default();
    let offsets = config.identity;
    if offsets.complete == 0 {
        return 0;
    }
    // SAFETY: sched_process_fork(struct task_struct *parent, struct task_struct *child); the
    // child's ids are read with the probe-read helper.
    unsafe {
        let child = *(ctx.as_ptr() as *const u64).add(1);
        let pid: i32 =
            bpf_probe_read_kernel((child + offsets.task_pid as u64) as *const i32).unwrap_or(0);
        let tgid: i32 =
            bpf_probe_read_kernel((child + offsets.task_tgid as u64) as *const i32).unwrap_or(-1);
        if pid != tgid || pid <= 0 {
            return 0;
        }
        let event = ForkEvent {
            header: ProcessEvent {
                ktime_ns: bpf_ktime_get_ns(),
                kind: EVENT_PROCESS_FORK,
                pid: tgid as u32,
            },
            details: ForkDetails {
                parent_pid: (bpf_get_current_pid_tgid() >> 32) as u32,
                parent_tid: bpf_get_current_pid_tgid() as u32,
                parent_cgroup_id: bpf_get_current_cgroup_id(),
            },
        };
        if EVENTS
            .output::<ForkEvent>(&event, BPF_RB_NO_WAKEUP as u64)
            .is_err()
        {
            count(STAT_EVENTS_LOST);
        }
    }
    0
}

/// Tells the agent a task moved to other cgroups (`cgroup_attach_task`,
/// `cgroup_transfer_tasks`: fired after the move, while forks wait on the cgroup lock, so the
/// event comes before any fork that inherits the new cgroups): what it knew of the process's
/// cgroups from before no longer holds. Where the BTF gave the offsets, the event says where
/// the task went (hierarchy and path), so the agent knows the new cgroups from the move on.
#[raw_tracepoint(tracepoint = "cgroup_attach_task")]
pub fn cgroup_migration(ctx: RawTracePointContext) -> i32 {
    let config = CONFIG.get(0).copied().unwrap_or_default();
    let offsets = config.identity;
    if offsets.complete == 0 {
        // Whose move is unknown, 0: every process's cgroups are in doubt.
        send_event(EVENT_CGROUP_MIGRATION, 0);
        return 0;
    }
    // SAFETY: (struct cgroup *dst_cgrp, const char *path, struct task_struct *task, bool
    // threadgroup); kernel memory is read with the probe-read helpers.
    let (dst_cgrp, path, task, threadgroup) = unsafe {
        let args = ctx.as_ptr() as *const u64;
        (*args, *args.add(1), *args.add(2), *args.add(3))
    };
    let (tgid, tid) = unsafe {
        let tgid = bpf_probe_read_kernel((task + offsets.task_tgid as u64) as *const i32)
            .map_or(0, |tgid| tgid.max(0) as u32);
        let tid = bpf_probe_read_kernel((task + offsets.task_pid as u64) as *const i32)
            .map_or(0, |tid| tid.max(0) as u32);
        (tgid, tid)
    };
    if config.cgroup_root_offset == 0 || config.cgroup_root_hierarchy_offset == 0 || tgid == 0 {
        send_event(EVENT_CGROUP_MIGRATION, tgid);
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<CgroupMoveEvent>(0) else {
        count(STAT_EVENTS_LOST);
        return 0;
    };
    // SAFETY: the reserved record is ours until submitted; every field is written below (the
    // path up to the length recorded).
    unsafe {
        let event = entry.as_mut_ptr();
        (*event).header = ProcessEvent {
            ktime_ns: bpf_ktime_get_ns(),
            kind: EVENT_CGROUP_MIGRATION,
            pid: tgid,
        };
        let details = &raw mut (*event).details;
        (*details).tid = tid;
        (*details).threadgroup = (threadgroup & 0xff != 0) as u32;
        (*details).path_len = 0;
        let root = read_kernel_u64(dst_cgrp + config.cgroup_root_offset as u64);
        (*details).hierarchy_id = if root == 0 {
            -1
        } else {
            bpf_probe_read_kernel((root + config.cgroup_root_hierarchy_offset as u64) as *const i32)
                .unwrap_or(-1)
        };
        if path != 0 {
            let copied = bpf_probe_read_kernel_str(
                (&raw mut (*details).path).cast(),
                CGROUP_MOVE_PATH_BYTES as u32,
                path as *const c_void,
            );
            if copied > 0 {
                (*details).path_len = copied as u32;
            }
        }
    }
    entry.submit(BPF_RB_NO_WAKEUP as u64);
    0
}

/// Tells the agent a cgroup was renamed or a hierarchy mounted or unmounted: the cgroup text
/// of any process may read otherwise now.
#[raw_tracepoint(tracepoint = "cgroup_rename")]
pub fn cgroups_changed(_ctx: RawTracePointContext) -> i32 {
    send_event(EVENT_CGROUPS_CHANGED, 0);
    0
}

#[inline(always)]
fn send_event(kind: u32, pid: u32) {
    let event = ProcessEvent {
        ktime_ns: unsafe { bpf_ktime_get_ns() },
        kind,
        pid,
    };
    // The agent polls the events ring on its own timer: no wakeup needed.
    if EVENTS
        .output::<ProcessEvent>(&event, BPF_RB_NO_WAKEUP as u64)
        .is_err()
    {
        count(STAT_EVENTS_LOST);
    }
}
