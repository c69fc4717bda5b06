//! `dynamo-node engine-guard`: the process between the node and one engine it launched, so that
//! the engine's whole process tree ends with the node however the node ends.
//!
//! vLLM's API server starts its engine core and workers as processes of its own; killing the API
//! server leaves them running, holding the port and the device's memory. A parent-death signal
//! on the API server alone does not reach them (it is not inherited), and a node killed outright
//! cannot stop anything. So the node starts this guard instead of the engine: the guard asks for
//! SIGTERM when the node dies, starts the engine in a process group of its own, and on SIGTERM,
//! SIGINT or SIGHUP (the node stopping it, or the node gone) signals that whole group, waits
//! `grace` for the engine to exit, then kills the group. When the engine exits by itself, what is
//! left of its group is killed. The guard exits with the engine's status.

use std::os::unix::process::CommandExt;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Runs `program` with `args` under the guard (see the module doc); `parent` is the node's pid:
/// a guard whose parent is already another process exits at once.
pub fn run(parent: u32, grace: Duration, program: &str, args: &[String]) -> ExitCode {
    // SAFETY: prctl(2) with PR_SET_PDEATHSIG and getppid(2) take and return plain integers.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) } != 0 || unsafe { libc::getppid() } as u32 != parent
    {
        say(format_args!("the node is gone; not starting {program}"));
        return ExitCode::from(1);
    }
    // The signals the guard acts on are blocked and taken with sigtimedwait; the engine starts
    // with them unblocked (a child inherits the mask), so it gets them as usual.
    let signals = signal_set(&[libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGCHLD]);
    // SAFETY: `signals` is an initialized set; this process runs one thread here.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut()) };
    let mut command = std::process::Command::new(program);
    command.args(args).stdin(std::process::Stdio::null()).process_group(0);
    let unblock = move || {
        // SAFETY: sigprocmask(2) on a set copied into this closure; async-signal-safe.
        if unsafe { libc::sigprocmask(libc::SIG_UNBLOCK, &signals, std::ptr::null_mut()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: the closure runs in the child between fork and exec and makes one
    // async-signal-safe call, allocating nothing.
    unsafe { command.pre_exec(unblock) };
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            say(format_args!("cannot start `{program}`: {e}"));
            return ExitCode::from(127);
        }
    };
    let group = child.id() as i32;
    // Until asked to stop (SIGTERM, SIGINT, SIGHUP), or the engine exits (SIGCHLD).
    while let Some(libc::SIGCHLD) | None = wait_signal(&signals, None) {
        if let Ok(Some(status)) = child.try_wait() {
            // What the engine left behind goes with it.
            kill_group(group, libc::SIGKILL);
            say(format_args!("the engine exited ({status})"));
            return exit_code(status);
        }
    }
    // Asked to stop: the whole group, gracefully first.
    kill_group(group, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            kill_group(group, libc::SIGKILL);
            return exit_code(status);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        wait_signal(&signals, Some(left.min(Duration::from_millis(200))));
    }
    kill_group(group, libc::SIGKILL);
    say(format_args!("the engine did not stop within {grace:?}; its process group was killed"));
    let _ = child.wait();
    ExitCode::from(137)
}

fn signal_set(signals: &[i32]) -> libc::sigset_t {
    // SAFETY: an all-zero sigset_t is a valid value to initialize.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for &signal in signals {
        // SAFETY: `set` is an initialized sigset_t and `signal` a valid signal number.
        unsafe { libc::sigaddset(&mut set, signal) };
    }
    set
}

/// Takes one of the blocked `signals`, waiting at most `limit` (for ever without one).
fn wait_signal(signals: &libc::sigset_t, limit: Option<Duration>) -> Option<i32> {
    let timeout = limit.map(|d| libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as _ });
    let timeout_ptr = timeout.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `signals` is an initialized set and `timeout_ptr` null or a live timespec; no
    // siginfo is asked for.
    let signal = unsafe { libc::sigtimedwait(signals, std::ptr::null_mut(), timeout_ptr) };
    (signal > 0).then_some(signal)
}

fn kill_group(group: i32, signal: i32) {
    // SAFETY: kill(2) on the process group this guard started; no memory is touched.
    unsafe { libc::kill(-group, signal) };
}

fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// Writes `message` to stderr (the node's log) if it still can: once the node is gone, its end of
/// the pipe is closed, and the guard must go on stopping the engine regardless.
fn say(message: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "engine-guard: {message}");
}
