//! Runs with GPU buffers fail with a clear message and a nonzero exit status, never a panic,
//! where CUDA is missing or the GPU does not exist: on machines without a GPU every GPU form
//! is checked; with GPUs, a GPU that does not exist.
use std::process::Command;

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fabric-debug")).args(args).output().expect("fabric-debug runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Exit status 1, nothing on stdout (no READY line), one error line naming `side`.
fn assert_refused(args: &[&str], side: &str, expected: &[&str]) {
    let (code, stdout, stderr) = run(args);
    assert_eq!(code, Some(1), "{args:?}: exit status; stderr: {stderr}");
    assert!(stdout.is_empty(), "{args:?} printed {stdout}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(stderr.starts_with(&format!("fabric-debug {side}: error: ")), "{args:?}: {stderr}");
    assert!(expected.iter().any(|e| stderr.contains(e)), "{args:?}: expected one of {expected:?} in {stderr}");
}

fn gpu_count() -> usize {
    cuda_lib::device_count().unwrap_or(0)
}

#[test]
fn gpu_runs_without_cuda_fail_clearly() {
    if gpu_count() > 0 {
        eprintln!("skipped: this machine has a GPU (gpu_that_does_not_exist_is_named covers it)");
        return;
    }
    let no_gpu = ["need CUDA", "need a GPU"];
    assert_refused(&["0", "1", "--listen", "127.0.0.1:0", "--provider", "tcp"], "server", &no_gpu);
    assert_refused(&["0,1", "2", "127.0.0.1:9", "--provider", "tcp"], "client", &no_gpu);
    assert_refused(&["server", "--gpus", "0", "--listen", "127.0.0.1:0", "--provider", "tcp"], "server", &no_gpu);
    assert_refused(&["client", "--gpus", "0", "--connect", "127.0.0.1:9", "--provider", "tcp"], "client", &no_gpu);
}

#[test]
fn gpu_that_does_not_exist_is_named() {
    let expected = ["GPU 999 does not exist", "need CUDA", "need a GPU"];
    assert_refused(&["999", "1", "--listen", "127.0.0.1:0", "--provider", "tcp"], "server", &expected);
    assert_refused(&["client", "--gpus", "0,999", "--connect", "127.0.0.1:9"], "client", &expected);
}

#[test]
fn bad_gpu_lists_are_usage_errors() {
    for (args, message) in [
        (&["0,,1", "2"][..], "entry 2 is empty"),
        (&["x", "2"][..], "'x' is not a GPU index"),
        (&["0,0", "2"][..], "GPU 0 is listed twice"),
        (&["server", "--gpus", "1,x"][..], "'x' is not a GPU index"),
    ] {
        let (code, _, stderr) = run(args);
        assert_eq!(code, Some(2), "{args:?}: clap's usage-error status; stderr: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}
