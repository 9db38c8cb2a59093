//! Triggered requests: a write, an immediate or a message, checked and planned now, that the
//! worker posts itself once an immediate has been counted often enough (see
//! `worker::triggers` for the counting rules). Between the arrival and the post there is no
//! thread hand-off, so a forwarding proxy or an echo reacts at the worker's speed.
use std::time::Duration;

use super::TransferEngine;
use crate::address::EngineAddress;
use crate::commands::{ArmCommand, Command};
use crate::completion::{Notify, OnDone};
use crate::descriptor::MrDescriptor;
use crate::error::{FabricError, Result};
use crate::requests::WriteRequest;

/// When a triggered request is posted: once `count` arrivals of immediate `imm` were counted
/// (arrivals before arming included, unless a generic immediate callback took them because
/// nobody claimed the value). The trigger consumes those arrivals: they never reach the
/// ImmCounter. With `timeout`, a trigger not reached in time fails its request with
/// [`FabricError::Timeout`] and returns the arrivals it had consumed to the ImmCounter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trigger {
    pub imm: u32,
    pub count: u64,
    pub timeout: Option<Duration>,
}

impl TransferEngine {
    /// Arms a write (checked in full now) to be posted when `when` is reached; `on_done` then
    /// reports it like [`TransferEngine::submit_write`]. The source region must stay registered
    /// until then (a write whose region was unregistered meanwhile fails when it fires).
    pub fn arm_write(&self, when: Trigger, req: &WriteRequest<'_>, on_done: OnDone) -> Result<()> {
        self.arm(when, self.plan_write(req, Notify::Callback(on_done))?)
    }

    /// Arms an immediate to the owner of `dst` (as [`TransferEngine::submit_imm`]).
    pub fn arm_imm(&self, when: Trigger, imm: u32, dst: &MrDescriptor, on_done: OnDone) -> Result<()> {
        self.arm(when, self.plan_imm(imm, dst, Notify::Callback(on_done))?)
    }

    /// Arms an immediate into `peer`'s immediate slot or inbox (as [`TransferEngine::submit_imm_to`]).
    pub fn arm_imm_to(&self, when: Trigger, imm: u32, peer: &EngineAddress, on_done: OnDone) -> Result<()> {
        self.arm(when, self.plan_imm_to(imm, peer, Notify::Callback(on_done))?)
    }

    /// Arms a message to `peer` (as [`TransferEngine::submit_send`]).
    pub fn arm_send(&self, when: Trigger, peer: &EngineAddress, data: Vec<u8>, on_done: OnDone) -> Result<()> {
        self.arm(when, self.plan_send(peer, data, Notify::Callback(on_done))?)
    }

    fn arm(&self, when: Trigger, request: Command) -> Result<()> {
        if when.count == 0 {
            return Err(FabricError::InvalidArgument("a trigger needs a count of at least 1".into()));
        }
        if let Some(t) = when.timeout {
            crate::config::check_timeout("trigger timeout", t)?;
        }
        self.command(Command::Arm(ArmCommand {
            imm: when.imm,
            count: when.count,
            timeout: when.timeout,
            request: Box::new(request),
        }))
    }
}
