//! One domain of a worker together with its library-owned buffers: the immediate scratch slot,
//! send buffers and the receive buffers it keeps posted.
use crate::config::EngineConfig;
use crate::error::Result;
use crate::msg_buffers::MsgBuffers;
use crate::provider::libfabric::{Access, DomainSpec, LibfabricDomain, OpContext, OpKind, Posted};

pub(crate) struct DomainState {
    pub scratch: MsgBuffers,
    pub send_buffers: MsgBuffers,
    pub free_send_slots: Vec<usize>,
    pub recv_buffers: MsgBuffers,
    // Boxed so each context keeps its address for as long as its receive is posted.
    #[allow(clippy::vec_box)]
    recv_contexts: Vec<Box<OpContext>>,
    pub recv_to_post: Vec<usize>,
    // Last: the buffers above hold the domain alive and are closed before it.
    pub domain: LibfabricDomain,
}

impl DomainState {
    pub fn open(index: usize, spec: &DomainSpec, config: &EngineConfig) -> Result<Self> {
        let mut domain = LibfabricDomain::open(spec)?;
        // The immediate slot: peers write zero bytes into it (the immediate is the point), and
        // it is the source of this engine's zero-byte writes. Nothing ever reads it.
        let scratch = MsgBuffers::new(&mut domain, 1, 64, Access::RemoteWrite)?;
        let sends = config.send_buffers.max(1);
        let send_buffers = MsgBuffers::new(&mut domain, sends, config.max_message_size, Access::MessagesOnly)?;
        let recvs = config.recv_buffers.max(1);
        // One spare byte per receive buffer: a message that fills it is longer than allowed.
        let recv_buffers = MsgBuffers::new(&mut domain, recvs, config.max_message_size + 1, Access::MessagesOnly)?;
        let mut state = DomainState {
            scratch,
            send_buffers,
            free_send_slots: (0..sends).rev().collect(),
            recv_buffers,
            recv_contexts: (0..recvs).map(|slot| OpContext::new(OpKind::Recv { slot, domain: index as u16 })).collect(),
            recv_to_post: (0..recvs).collect(),
            domain,
        };
        state.post_receives()?;
        Ok(state)
    }

    /// Addresses of this domain's receive contexts, by slot (to recognise them in completions).
    pub fn recv_context_addresses(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.recv_contexts.iter().enumerate().map(|(slot, c)| (&**c as *const OpContext as usize, slot))
    }

    /// (key, remote base) of the scratch slot: the target of immediates sent to this engine.
    pub fn imm_target(&self) -> (u64, u64) {
        (self.scratch.key(), self.scratch.remote_base())
    }

    /// Posts every receive buffer waiting to be (re)posted, until the provider pushes back.
    pub fn post_receives(&mut self) -> Result<()> {
        while let Some(slot) = self.recv_to_post.pop() {
            let ptr = self.recv_buffers.slot_ptr(slot);
            let len = self.recv_buffers.slot_size();
            let desc = self.recv_buffers.desc();
            let context: *mut OpContext = &mut *self.recv_contexts[slot];
            // SAFETY: receive buffers and their contexts live as long as this DomainState, which
            // closes the endpoint (via the domain) only after them.
            if let Posted::Again = unsafe { self.domain.post_recv(ptr, len, desc, context) }? {
                self.recv_to_post.push(slot);
                break;
            }
        }
        Ok(())
    }
}
