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
        self.command(Command::Send(SendCommand {
            peer: peer.domains[0].endpoint.clone(),
            data,
            on_done: Notify::Callback(on_done),
        }))
    }

    /// Installs the callback for received messages (`None` keeps messages until one is set).
    pub fn set_recv_callback(&self, callback: Option<RecvCallback>) -> Result<()> {
        self.command(Command::SetRecvCallback(callback))
    }
}
