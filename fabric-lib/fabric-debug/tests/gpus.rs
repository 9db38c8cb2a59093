//! `fabric-debug --gpus` runs on any machine: with GPUs it lists them, without it says so; either
//! way it checks the providers it was given and exits successfully.
use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fabric-debug")).args(args).output().expect("fabric-debug runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn gpus_report_lists_gpus_or_says_there_are_none() {
    let (ok, stdout, stderr) = run(&["--gpus", "--gpu-provider", "tcp,shm"]);
    assert!(ok, "exit status; stderr: {stderr}");
    assert!(stdout.starts_with("libfabric "), "{stdout}");
    let gpus = cuda_lib::device_count().unwrap_or(0);
    if gpus == 0 {
        assert!(stdout.contains("no GPU"), "{stdout}");
    } else {
        for ordinal in 0..gpus {
            assert!(stdout.contains(&format!("cuda:{ordinal} ")), "{stdout}");
        }
    }
    // tcp never has FI_HMEM; shm has it only in a CUDA-enabled libfabric.
    let tcp = stdout.lines().find(|l| l.starts_with("tcp")).unwrap_or_else(|| panic!("no tcp line: {stdout}"));
    assert!(tcp.split_whitespace().nth(1) == Some("no"), "{tcp}");
    assert!(stdout.lines().any(|l| l.starts_with("shm")), "{stdout}");
}

#[test]
fn gpus_report_as_json() {
    let (ok, stdout, stderr) = run(&["--gpus", "--gpu-provider", "tcp", "--gpu-json"]);
    assert!(ok, "exit status; stderr: {stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON object");
    let providers = report["providers"].as_array().expect("providers");
    assert_eq!(providers.len(), 1);
    assert!(providers[0]["provider"].as_str().unwrap().starts_with("tcp"));
    assert_eq!(providers[0]["fi_hmem"], false);
    let gpus = report["gpus"].as_array().expect("gpus").len();
    assert_eq!(gpus == 0, report["no_gpu"].is_string(), "{stdout}");
    for gpu in report["gpus"].as_array().unwrap() {
        assert_eq!(gpu["registrations"][0]["registration"], "no", "tcp cannot register GPU memory");
    }
}

#[test]
fn gpus_and_a_command_do_not_mix() {
    let (ok, _, stderr) = run(&["--gpus", "server"]);
    assert!(!ok);
    assert!(stderr.contains("--gpus"), "{stderr}");
}
