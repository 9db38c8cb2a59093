//! One server session: follows a client engine's control messages (verify immediate counts,
//! echo pings, done) for one server engine until the client says `Done`.
use std::sync::{Arc, Weak};
use std::time::Duration;

use fabric_lib::{EngineAddress, MrDescriptor, PostRecord, TransferEngine};

use crate::bootstrap::{Channel, Control};
use crate::endpoint::Endpoint;
use crate::error::{Context, Result};
use crate::report::{median, percentile};
use crate::server::{EchoKind, ServeArgs};

/// Serves one client connection on `ep` until it says `Done`.
pub fn serve(ep: &Endpoint, mut ch: Channel, args: &ServeArgs) -> Result<()> {
    let name = ep.placement.name();
    ch.send(&Control::hello(ep.engine.main_address(), &ep.descriptor))?;
    let (client, client_mr) = ch.recv()?.into_peer().context("client hello")?;
    eprintln!("fabric-debug server: {name}: client {} connected ({} region)", ch.peer(), client_mr.len);
    let client_mr = Arc::new(client_mr);
    let verify_timeout = Duration::from_secs(args.verify_timeout);
    loop {
        match ch.recv().with_context(|| name.clone())? {
            Control::Expect { imm, count, fence } => {
                let verdict = verify(&ep.engine, imm, count, fence, verify_timeout);
                if let Control::Reply { ok: false, message } = &verdict {
                    eprintln!("fabric-debug server: {name}: verification failed: {message}");
                }
                send_verdict(&ep.engine, &client, verdict)?;
            }
            Control::Echo { ping, pong, count } => {
                match args.echo {
                    EchoKind::Triggered => {
                        if args.echo_breakdown {
                            // One record per pong, each with the ping that fired it.
                            ep.engine.latency_probe().enable_post_log(count as usize);
                        }
                        arm_triggered_echo(&ep.engine, &client_mr, ping, pong, count)?
                    }
                    EchoKind::Callback => arm_echo(Arc::downgrade(&ep.engine), client_mr.clone(), ping, pong, count)?,
                }
                ch.send(&Control::Reply { ok: true, message: format!("echoing {count} pings") })?;
            }
            Control::Done => {
                ch.send(&Control::Reply { ok: true, message: "bye".into() })?;
                // Empty (nothing printed) unless `--echo-breakdown` started the log.
                report_turnarounds(&turnarounds(&ep.engine.latency_probe().take_post_log()));
                eprintln!("fabric-debug server: {name}: session done");
                return Ok(());
            }
            other => crate::bail!("{name}: unexpected control message from the client: {other:?}"),
        }
    }
}

/// Waits for `count` arrivals of `imm`, then the fence; reports the outcome as a reply.
fn verify(engine: &TransferEngine, imm: u32, count: u64, fence: u32, timeout: Duration) -> Control {
    let result = engine
        .wait_imm_count(imm, count, timeout)
        .map_err(|e| format!("immediate {imm}: {e} (count now {})", engine.imm_count(imm)))
        .and_then(|()| engine.wait_imm_count(fence, 1, timeout).map_err(|e| format!("fence {fence}: {e}")));
    match result {
        Ok(()) => {
            let surplus = engine.imm_count(imm);
            if surplus == 0 {
                Control::Reply { ok: true, message: format!("counted {count} of immediate {imm}") }
            } else {
                Control::Reply {
                    ok: false,
                    message: format!("immediate {imm}: {surplus} more than the {count} expected"),
                }
            }
        }
        Err(message) => Control::Reply { ok: false, message },
    }
}

/// Sends the verdict to the client over the fabric (a two-sided message).
fn send_verdict(engine: &TransferEngine, client: &EngineAddress, verdict: Control) -> Result<()> {
    engine
        .submit_send(
            client,
            verdict.to_bytes(),
            Box::new(|r| {
                if let Err(e) = r {
                    eprintln!("fabric-debug server: sending a verdict failed: {e}");
                }
            }),
        )
        .context("sending the verdict message")
}

/// Per pong, microseconds from reading the ping to firing the pong and to its post returning,
/// from the latency probe's post log (every pong is there: a later ping cannot overwrite it).
fn turnarounds(log: &[PostRecord]) -> Vec<(f64, f64)> {
    let us = |ns: u64| ns as f64 / 1e3;
    log.iter()
        .filter(|r| r.seen_ns != 0 && r.seen_ns <= r.dequeued_ns && r.dequeued_ns <= r.posted_ns)
        .map(|r| (us(r.dequeued_ns - r.seen_ns), us(r.posted_ns - r.dequeued_ns)))
        .collect()
}

/// Prints p50/p99 of the recorded turnarounds on stderr (nothing if none were recorded).
fn report_turnarounds(samples: &[(f64, f64)]) {
    if samples.is_empty() {
        return;
    }
    let (fire, post): (Vec<f64>, Vec<f64>) = samples.iter().copied().unzip();
    eprintln!(
        "fabric-debug server: ping -> pong ({} pongs, p50 / p99 us): imm_seen_to_fired {:.2} / {:.2}, \
         fired_to_posted {:.2} / {:.2}",
        samples.len(),
        median(&fire),
        percentile(&fire, 99.0),
        median(&post),
        percentile(&post, 99.0)
    );
}

/// Arms one triggered `pong` per expected `ping`: the worker posts each pong as soon as it
/// counted the ping, with no thread in between.
fn arm_triggered_echo(engine: &TransferEngine, dst: &MrDescriptor, ping: u32, pong: u32, count: u64) -> Result<()> {
    for _ in 0..count {
        let on_done = Box::new(move |r: fabric_lib::Result<()>| match r {
            Ok(()) => {}
            // The session may end before the last pong's local completion is read.
            Err(fabric_lib::FabricError::Stopped) => {}
            Err(err) => eprintln!("fabric-debug server: pong failed: {err}"),
        });
        let when = fabric_lib::Trigger { imm: ping, count: 1, timeout: None };
        engine.arm_imm_to(when, pong, &dst.owner, on_done).context("arming a triggered pong")?;
    }
    Ok(())
}

/// Answers the next `remaining` arrivals of `ping` with `pong`, re-arming the expectation from
/// its own callback. Holds the engine weakly so the chain never keeps it alive.
fn arm_echo(engine: Weak<TransferEngine>, dst: Arc<MrDescriptor>, ping: u32, pong: u32, remaining: u64) -> Result<()> {
    if remaining == 0 {
        return Ok(());
    }
    let Some(strong) = engine.upgrade() else { return Ok(()) };
    strong
        .set_imm_count_expected(
            ping,
            1,
            Box::new(move || {
                let Some(e) = engine.upgrade() else { return };
                let on_done = Box::new(|r: fabric_lib::Result<()>| match r {
                    // The session may end before the last pong's local completion is read.
                    Ok(()) | Err(fabric_lib::FabricError::Stopped) => {}
                    Err(err) => eprintln!("fabric-debug server: pong failed: {err}"),
                });
                if let Err(err) = e.submit_imm_to(pong, &dst.owner, on_done) {
                    eprintln!("fabric-debug server: posting a pong failed: {err}");
                }
                if let Err(err) = arm_echo(engine, dst, ping, pong, remaining - 1) {
                    eprintln!("fabric-debug server: re-arming the echo failed: {err}");
                }
            }),
        )
        .context("arming the echo expectation")
}
