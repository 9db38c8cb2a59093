//! Two-sided messages through library-owned buffers.
use super::TransferEngine;
use crate::address::EngineAddress;
use crate::commands::{Command, RecvCallback, SendCommand};
use crate::completion::{Notify, OnDone};
use crate::error::{FabricError, Result};

impl TransferEngine {
    /// Sends a small two-sided message (at most `max_message_size` bytes) to `peer`, whose
    /// receive callback gets the bytes.
    pub fn submit_send(&self, peer: &EngineAddress, data: Vec<u8>, on_done: OnDone) -> Result<()> {
        self.command(self.plan_send(peer, data, Notify::Callback(on_done))?)
    }

    /// Checks a message against both engines' limits and wraps it in its command.
    pub(super) fn plan_send(&self, peer: &EngineAddress, data: Vec<u8>, on_done: Notify) -> Result<Command> {
        self.check_peer(peer)?;
        if data.len() > self.config.max_message_size {
            return Err(FabricError::InvalidArgument(format!(
                "message of {} bytes exceeds this engine's max_message_size ({})",
                data.len(),
                self.config.max_message_size
            )));
        }
        if data.len() as u64 > peer.max_message_size {
            return Err(FabricError::InvalidArgument(format!(
                "message of {} bytes exceeds the receiving engine's max_message_size ({})",
                data.len(),
                peer.max_message_size
            )));
        }
        Ok(Command::Send(SendCommand { peer: self.peer_id(peer)?, data, on_done }))
    }

    /// Installs the callback for received messages (`None` keeps messages until one is set).
    pub fn set_recv_callback(&self, callback: Option<RecvCallback>) -> Result<()> {
        self.command(Command::SetRecvCallback(callback))
    }
}
