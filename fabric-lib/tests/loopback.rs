//! Two engines in one process, over real libfabric providers on loopback.
use std::sync::mpsc;
use std::time::Duration;

use fabric_lib::{EngineConfig, FabricError, MemoryKind, MrDescriptor, PollMode, ProviderSpec, TransferEngine, WriteRequest};

fn engine(provider: &str) -> TransferEngine {
    let config = EngineConfig {
        provider: ProviderSpec { provider: Some(provider.into()), domain: None },
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    TransferEngine::new(config).unwrap_or_else(|e| panic!("opening {provider}: {e}"))
}

fn wait(rx: &mpsc::Receiver<fabric_lib::Result<()>>) {
    rx.recv_timeout(Duration::from_secs(20)).expect("completion in time").expect("transfer ok");
}

fn register(e: &TransferEngine, buf: &mut [u8]) -> (fabric_lib::MrHandle, MrDescriptor) {
    // SAFETY: the buffers outlive the engines in these tests (engines are dropped first).
    unsafe { e.register_memory(buf.as_mut_ptr(), buf.len(), MemoryKind::Host) }.unwrap()
}

fn write_imm_and_message(provider: &str) {
    let mut src = vec![0u8; 1 << 20];
    let mut dst = vec![0u8; 1 << 20];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let a = engine(provider);
    let b = engine(provider);
    let (src_h, _) = register(&a, &mut src);
    let (_, dst_desc) = register(&b, &mut dst);
    let dst_desc = MrDescriptor::from_bytes(&dst_desc.to_bytes()).unwrap();

    let (tx, rx) = mpsc::channel();
    let n_writes = 16u64;
    let chunk = (1u64 << 20) / n_writes;
    for i in 0..n_writes {
        let tx = tx.clone();
        let req = WriteRequest { src: src_h, src_offset: i * chunk, len: chunk, dst: &dst_desc, dst_offset: i * chunk, imm: Some(42) };
        a.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    }
    b.wait_imm_count(42, n_writes, Duration::from_secs(20)).unwrap();
    for _ in 0..n_writes {
        wait(&rx);
    }
    assert!(src == dst, "every byte arrives");

    let tx2 = tx.clone();
    a.submit_imm(7, &dst_desc, Box::new(move |r| tx2.send(r).unwrap())).unwrap();
    wait(&rx);
    b.wait_imm_count(7, 1, Duration::from_secs(20)).unwrap();

    let (mtx, mrx) = mpsc::channel();
    b.set_recv_callback(Some(std::sync::Arc::new(move |m: Vec<u8>| mtx.send(m).unwrap()))).unwrap();
    let tx3 = tx.clone();
    a.submit_send(b.main_address(), b"hello fabric".to_vec(), Box::new(move |r| tx3.send(r).unwrap())).unwrap();
    wait(&rx);
    assert_eq!(mrx.recv_timeout(Duration::from_secs(20)).unwrap(), b"hello fabric");

    let bad = WriteRequest { src: src_h, src_offset: 1, len: 1 << 20, dst: &dst_desc, dst_offset: 0, imm: None };
    assert!(matches!(a.submit_write(&bad, Box::new(|_| {})), Err(FabricError::InvalidArgument(_))));
    a.stop();
    a.stop();
    assert_eq!(a.submit_imm(1, &dst_desc, Box::new(|_| {})), Err(FabricError::Stopped));
    drop(a);
    drop(b);
}

#[test]
fn tcp_write_imm_and_message() {
    write_imm_and_message("tcp");
}

#[test]
fn shm_write_imm_and_message() {
    write_imm_and_message("shm");
}

#[test]
fn unknown_provider_is_a_typed_error() {
    let config = EngineConfig { provider: ProviderSpec { provider: Some("no-such-provider".into()), domain: None }, ..Default::default() };
    assert!(matches!(TransferEngine::new(config), Err(FabricError::ProviderUnavailable(_))));
}
