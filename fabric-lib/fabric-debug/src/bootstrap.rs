//! Out-of-band bootstrap over plain TCP: length-prefixed JSON frames carry the engine addresses
//! and memory descriptors (hex of their versioned bytes) and the few control messages that
//! sequence the tests. Every socket operation is bounded by a timeout.
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use fabric_lib::{EngineAddress, MrDescriptor};
use serde::{Deserialize, Serialize};

use crate::bail;
use crate::error::{Context, Error, Result};

/// Largest frame accepted; anything longer is garbage, not a control message.
const MAX_FRAME: u32 = 1 << 20;

/// One control message. The client drives; the server answers.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Control {
    /// The client's first message on a connection: it pairs with the server's engine `engine`
    /// (GPU `i` with GPU `i`) of the `engines` the client runs. The server answers with that
    /// engine's `Hello`, or a failed `Reply` (no such engine, taken, or a different count).
    Attach { engine: usize, engines: usize },
    /// An engine's address and one registered region, as hex of their versioned bytes.
    Hello { address: String, descriptor: String },
    /// Server: wait for `count` arrivals of `imm`, then one of `fence`, then answer with a
    /// fabric message (`submit_send`) carrying a [`Control::Reply`].
    Expect { imm: u32, count: u64, fence: u32 },
    /// Server: answer each of the next `count` arrivals of `ping` with an immediate `pong`.
    Echo { ping: u32, pong: u32, count: u64 },
    /// Server: acknowledge and end the session.
    Done,
    /// The server's answer to `Expect` (over the fabric), `Echo` and `Done` (over TCP), and its
    /// refusal of an `Attach`.
    Reply { ok: bool, message: String },
}

impl Control {
    /// The `Hello` of an engine and one of its regions.
    pub fn hello(address: &EngineAddress, descriptor: &MrDescriptor) -> Self {
        Control::Hello { address: address.to_hex(), descriptor: hex::encode(descriptor.to_bytes()) }
    }

    /// Decodes a `Hello`; a refusal, anything else, or undecodable bytes, is an error.
    pub fn into_peer(self) -> Result<(EngineAddress, MrDescriptor)> {
        let (address, descriptor) = match self {
            Control::Hello { address, descriptor } => (address, descriptor),
            Control::Reply { ok: false, message } => bail!("the server refused: {message}"),
            other => bail!("expected the peer's hello, got {other:?}"),
        };
        let address = EngineAddress::from_hex(&address).context("decoding the peer's engine address")?;
        let bytes = hex::decode(descriptor.trim()).context("decoding the peer's descriptor hex")?;
        let descriptor = MrDescriptor::from_bytes(&bytes).context("decoding the peer's memory descriptor")?;
        Ok((address, descriptor))
    }

    /// Turns a `Reply` into `Ok(message)` or an error carrying the server's message.
    pub fn into_ok(self, what: &str) -> Result<String> {
        match self {
            Control::Reply { ok: true, message } => Ok(message),
            Control::Reply { ok: false, message } => bail!("{what}: server reported failure: {message}"),
            other => bail!("{what}: expected a reply, got {other:?}"),
        }
    }

    /// Serialized as JSON bytes (also used for fabric messages).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("control messages always serialize")
    }

    /// Parses [`Control::to_bytes`] output.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes).context("malformed control message")
    }
}

/// A connected bootstrap socket.
pub struct Channel {
    stream: TcpStream,
    peer: SocketAddr,
}

impl Channel {
    fn new(stream: TcpStream, io_timeout: Duration) -> Result<Self> {
        let peer = stream.peer_addr().context("reading the bootstrap peer address")?;
        stream.set_nonblocking(false).context("configuring the bootstrap socket")?;
        stream.set_nodelay(true).context("configuring the bootstrap socket")?;
        stream.set_read_timeout(Some(io_timeout)).context("configuring the bootstrap socket")?;
        stream.set_write_timeout(Some(io_timeout)).context("configuring the bootstrap socket")?;
        Ok(Channel { stream, peer })
    }

    /// Connects to `addr` (`HOST:PORT`), retrying refused connections until `timeout` passes
    /// (the server may still be starting).
    pub fn connect(addr: &str, timeout: Duration, io_timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let targets: Vec<SocketAddr> =
            addr.to_socket_addrs().with_context(|| format!("resolving '{addr}' (expected HOST:PORT)"))?.collect();
        let Some(target) = targets.first().copied() else { bail!("'{addr}' resolves to no address") };
        loop {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
            match TcpStream::connect_timeout(&target, left) {
                Ok(stream) => return Channel::new(stream, io_timeout),
                Err(e) if Instant::now() < deadline && e.kind() == ErrorKind::ConnectionRefused => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => bail!("connecting to {target} (for {timeout:?}): {e}"),
            }
        }
    }

    /// Waits up to `timeout` for one client on `listener`.
    pub fn accept(listener: &TcpListener, timeout: Duration, io_timeout: Duration) -> Result<Self> {
        listener.set_nonblocking(true).context("configuring the listening socket")?;
        let deadline = Instant::now() + timeout;
        loop {
            match listener.accept() {
                Ok((stream, _)) => return Channel::new(stream, io_timeout),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        bail!("no client connected within {timeout:?}");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => bail!("accepting a bootstrap connection: {e}"),
            }
        }
    }

    /// The other side's socket address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Sends one frame: a big-endian u32 length, then the JSON bytes.
    pub fn send(&mut self, msg: &Control) -> Result<()> {
        let body = msg.to_bytes();
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&body);
        self.stream.write_all(&frame).with_context(|| format!("sending to {}", self.peer))
    }

    /// Receives one frame (bounded by the I/O timeout).
    pub fn recv(&mut self) -> Result<Control> {
        let mut len = [0u8; 4];
        self.read_exact(&mut len)?;
        let len = u32::from_be_bytes(len);
        if len > MAX_FRAME {
            bail!("bootstrap frame of {len} bytes from {} exceeds {MAX_FRAME}: not a fabric-debug peer?", self.peer);
        }
        let mut body = vec![0u8; len as usize];
        self.read_exact(&mut body)?;
        Control::from_bytes(&body).with_context(|| format!("frame from {}", self.peer))
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        self.stream.read_exact(buf).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => Error(format!("timed out waiting for {}", self.peer)),
            ErrorKind::UnexpectedEof => Error(format!("{} closed the bootstrap connection", self.peer)),
            _ => Error(format!("reading from {}: {e}", self.peer)),
        })
    }
}
