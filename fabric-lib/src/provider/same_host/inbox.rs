//! Same-host immediates through shared memory: every engine owns an *inbox*, a bounded ring of
//! (writer epoch tag, immediate) entries in a memfd, and same-host writers push the immediate of
//! a finished write there instead of announcing it with a write over the provider.
//!
//! Sharing: the owner creates the memfd (`MFD_ALLOW_SEALING`), sizes it and seals its size
//! (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`, so no peer holding it can truncate it under the
//! owner's mapping), maps it and announces (pid, descriptor number, random nonce, slots) in its
//! `EngineAddress`. A writer opens `/proc/<pid>/fd/<fd>`: this needs the same read access to
//! the owner as reading its `/proc` entries (same user; Yama's `ptrace_scope` does not apply),
//! not the ptrace attach right `process_vm_writev` needs, and nothing is left behind in a
//! file system when either side dies. The writer checks the link names our memfd, that the file
//! is a sealed regular file of the announced size and that its header carries the announced
//! nonce; anything else (another pid namespace, a reused descriptor, no permission) is an error
//! and the writer falls back to the provider.
//!
//! The ring (Vyukov's bounded queue with the entry inside the sequence word): slot `i` is one
//! 128-bit atomic (sequence number above, `tag << 32 | imm` below); position `p` is free when its
//! slot's sequence is `p` and published when it is `p + 1`. A writer publishes with one 128-bit
//! compare-and-swap, so a writer killed at any instant leaves either nothing or a whole entry;
//! the shared `tail` is only a hint that any writer advances. The owner consumes in order,
//! marking the slot free for the next lap (`p + slots`). A full ring is reported to the writer,
//! which retries (back-pressure): nothing is dropped.
//!
//! Hostile input: any same-host process that opened the inbox can write anything into it. The
//! owner trusts none of it: its own head, slot count and nonce are private; a slot at the head
//! that is neither free nor published, or an entry with tag 0 or the control tag, is refused
//! (counted, logged) and skipped; accepted entries pass the same epoch filter as immediates
//! from the provider. A peer can still forge well-formed immediates or stall the ring (writers
//! then time out with typed errors); it cannot make the owner touch memory outside the mapping.
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use portable_atomic::AtomicU128;

use crate::address::InboxAddress;
use crate::epoch::CONTROL_TAG;
use crate::error::{FabricError, Result};

/// Largest inbox (entries).
pub(crate) const MAX_INBOX_SLOTS: usize = 1 << 20;
const MAGIC: u64 = u64::from_le_bytes(*b"FLINBOX1");
/// The memfd's name, as `/proc/<pid>/fd/<fd>` shows it.
const NAME: &str = "fabric-lib-inbox";
/// Header: magic, nonce, slots on the first cache line; the tail hint alone on the second.
const HEADER: usize = 128;
const TAIL_OFFSET: usize = 64;
const SLOT: usize = 16;
/// Compare-and-swap rounds a push tries against other writers before reporting "full".
const PUSH_ATTEMPTS: usize = 64;

fn inbox_len(slots: usize) -> usize {
    HEADER + slots * SLOT
}

fn os_error(what: &str) -> FabricError {
    FabricError::InvalidArgument(format!("same-host inbox: {what}: {}", std::io::Error::last_os_error()))
}

/// Whether this CPU has lock-free 128-bit atomics (a lock would not be shared between processes).
pub(crate) fn inbox_supported() -> bool {
    AtomicU128::is_lock_free()
}

/// A shared mapping of an inbox.
struct Mapping {
    ptr: *mut u8,
    len: usize,
    mask: u64,
}

// SAFETY: the mapping is plain shared memory accessed only through atomics.
unsafe impl Send for Mapping {}

impl Mapping {
    fn map(fd: &OwnedFd, len: usize, slots: usize) -> Result<Self> {
        // SAFETY: a fresh shared mapping of `len` bytes of a file at least that long (checked or
        // sized by the caller, and sealed against shrinking).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        Ok(Mapping { ptr: ptr.cast(), len, mask: slots as u64 - 1 })
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset < HEADER, 8-aligned, inside the mapping (page-aligned); shared memory is
        // only ever accessed atomically.
        unsafe { AtomicU64::from_ptr(self.ptr.add(offset).cast()) }
    }

    fn tail(&self) -> &AtomicU64 {
        self.word(TAIL_OFFSET)
    }

    fn slot(&self, position: u64) -> &AtomicU128 {
        let index = (position & self.mask) as usize;
        // SAFETY: index < slots, so the 16-aligned slot lies inside the mapping.
        unsafe { AtomicU128::from_ptr(self.ptr.add(HEADER + index * SLOT).cast()) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; nothing borrows it any more.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn pack(seq: u64, tag: u32, imm: u32) -> u128 {
    (u128::from(seq) << 64) | (u128::from(tag) << 32) | u128::from(imm)
}

/// What a drain found: entries handed on, and slots or entries refused as malformed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Drained {
    pub taken: usize,
    pub refused: u64,
}

/// The owner's side: creates the inbox and consumes it.
pub(crate) struct Inbox {
    map: Mapping,
    _fd: OwnedFd,
    address: InboxAddress,
    slots: u64,
    head: u64,
    polls: u32,
}

impl Inbox {
    /// Creates an inbox of `slots` entries (a power of two in 2..=2^20).
    pub fn create(slots: usize) -> Result<Self> {
        if !slots.is_power_of_two() || !(2..=MAX_INBOX_SLOTS).contains(&slots) {
            return Err(FabricError::InvalidArgument(format!(
                "same_host_inbox_slots must be 0 or a power of two in 2..={MAX_INBOX_SLOTS}, got {slots}"
            )));
        }
        if !inbox_supported() {
            return Err(FabricError::InvalidArgument("no lock-free 128-bit atomics on this CPU".into()));
        }
        let name = CString::new(NAME).expect("no NUL");
        // SAFETY: plain syscalls on a descriptor we own.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: a fresh descriptor, owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = inbox_len(slots);
        // SAFETY: plain syscalls on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_error("ftruncate"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_error("sealing"));
        }
        let map = Mapping::map(&fd, len, slots)?;
        let nonce = getrandom::u64().map_err(|e| FabricError::InvalidArgument(format!("no random source: {e}")))?;
        for i in 0..slots as u64 {
            map.slot(i).store(pack(i, 0, 0), Ordering::Relaxed);
        }
        map.word(8).store(nonce, Ordering::Relaxed);
        map.word(16).store(slots as u64, Ordering::Relaxed);
        map.word(0).store(MAGIC, Ordering::Release);
        let address = InboxAddress { fd: fd.as_raw_fd() as u32, nonce, slots: slots as u32 };
        Ok(Inbox { map, _fd: fd, address, slots: slots as u64, head: 0, polls: 0 })
    }

    pub fn address(&self) -> InboxAddress {
        self.address
    }

    /// Hands up to `max` published entries, in order, to `take(tag, imm)`; malformed ones are
    /// refused. Cheap when empty: one load of the tail hint (every 64th call looks at the head
    /// slot too, for an entry whose writer died before advancing the hint).
    pub fn drain(&mut self, max: usize, mut take: impl FnMut(u32, u32)) -> Drained {
        let mut out = Drained::default();
        self.polls = self.polls.wrapping_add(1);
        if self.map.tail().load(Ordering::Acquire) == self.head && !self.polls.is_multiple_of(64) {
            return out;
        }
        while out.taken + (out.refused as usize) < max {
            let slot = self.map.slot(self.head);
            let current = slot.load(Ordering::Acquire);
            let seq = (current >> 64) as u64;
            if seq == self.head {
                break; // free: nothing published here yet
            }
            // Consumed: free for the writers of the next lap.
            slot.store(pack(self.head.wrapping_add(self.slots), 0, 0), Ordering::Release);
            self.head = self.head.wrapping_add(1);
            let (tag, imm) = ((current >> 32) as u32, current as u32);
            if seq != self.head || tag == 0 || tag == CONTROL_TAG {
                out.refused += 1; // a slot no writer of ours can produce
            } else {
                take(tag, imm);
                out.taken += 1;
            }
        }
        out
    }
}

/// A writer's mapping of a peer's inbox.
pub(crate) struct PeerInbox {
    map: Mapping,
    slots: u64,
    /// The owner process (a pidfd: immune to pid reuse). The mapping keeps the memfd alive after
    /// its owner died, so a push alone would still succeed; writers ask this first.
    owner: OwnedFd,
}

impl PeerInbox {
    /// Maps the inbox of process `pid` described by `address` (checked as the module says).
    pub fn open(pid: u32, address: &InboxAddress) -> Result<Self> {
        let slots = address.slots as usize;
        if !slots.is_power_of_two() || !(2..=MAX_INBOX_SLOTS).contains(&slots) || !inbox_supported() {
            return Err(FabricError::InvalidDescriptor(format!("same-host inbox of {slots} slots")));
        }
        let path = format!("/proc/{pid}/fd/{}", address.fd);
        let bad = |why: String| FabricError::InvalidDescriptor(format!("same-host inbox {path}: {why}"));
        // Never open what is not our memfd (a reused descriptor may name a device or a FIFO).
        let target = std::fs::read_link(&path).map_err(|e| bad(e.to_string()))?;
        if !target.to_string_lossy().starts_with(&format!("/memfd:{NAME}")) {
            return Err(bad(format!("names {target:?}, not an inbox")));
        }
        let c_path = CString::new(path.clone()).expect("no NUL");
        // SAFETY: plain syscall; the descriptor is owned from here on.
        let fd = unsafe { libc::open(c_path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(bad(std::io::Error::last_os_error().to_string()));
        }
        // SAFETY: just opened.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = inbox_len(slots);
        // SAFETY: `stat` is plain data filled by the kernel.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(bad(std::io::Error::last_os_error().to_string()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size as u64 != len as u64 {
            return Err(bad(format!("not a regular file of {len} bytes")));
        }
        // SAFETY: plain syscall.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) != (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) {
            return Err(bad("its size is not sealed".into()));
        }
        // SAFETY: plain syscall; a non-negative result is a descriptor owned from here on.
        let owner = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0 as libc::c_long) };
        if owner < 0 {
            return Err(bad(format!("no pidfd for its owner: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: just opened.
        let owner = unsafe { OwnedFd::from_raw_fd(owner as i32) };
        let map = Mapping::map(&fd, len, slots)?;
        let header = [map.word(0), map.word(8), map.word(16)].map(|w| w.load(Ordering::Acquire));
        if header != [MAGIC, address.nonce, slots as u64] {
            return Err(bad("header does not match the address (another engine's, or a stale address)".into()));
        }
        Ok(PeerInbox { map, slots: slots as u64, owner })
    }

    /// Whether the inbox's owner process has exited (its pidfd became readable).
    pub fn owner_exited(&self) -> bool {
        let mut pfd = libc::pollfd { fd: self.owner.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut pfd, 1, 0) > 0 && pfd.revents != 0 }
    }

    /// Publishes one entry; false when the ring is full (or contended past reason): retry later.
    pub fn push(&self, tag: u32, imm: u32) -> bool {
        let tail = self.map.tail();
        for _ in 0..PUSH_ATTEMPTS {
            let position = tail.load(Ordering::Acquire);
            let slot = self.map.slot(position);
            let current = slot.load(Ordering::Acquire);
            let seq = (current >> 64) as u64;
            if seq == position {
                let entry = pack(position.wrapping_add(1), tag, imm);
                if slot.compare_exchange(current, entry, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    let _ =
                        tail.compare_exchange(position, position.wrapping_add(1), Ordering::AcqRel, Ordering::Relaxed);
                    return true;
                }
            } else if seq == position.wrapping_add(1) || seq == position.wrapping_add(self.slots) {
                // Published or already consumed: the hint lags; move it on.
                let _ = tail.compare_exchange(position, position.wrapping_add(1), Ordering::AcqRel, Ordering::Relaxed);
            } else if seq.wrapping_add(self.slots) == position.wrapping_add(1) {
                return false; // the previous lap's entry is still unread: full
            }
            std::hint::spin_loop();
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(slots: usize) -> (Inbox, PeerInbox) {
        let inbox = Inbox::create(slots).unwrap();
        let peer = PeerInbox::open(std::process::id(), &inbox.address()).unwrap();
        (inbox, peer)
    }

    fn drain_all(inbox: &mut Inbox) -> (Vec<(u32, u32)>, u64) {
        let mut got = Vec::new();
        let mut refused = 0;
        // Past the tail-hint shortcut: every 64th call looks at the slot itself.
        for _ in 0..64 {
            refused += inbox.drain(usize::MAX, |t, i| got.push((t, i))).refused;
        }
        (got, refused)
    }

    #[test]
    fn entries_arrive_in_order_and_a_full_ring_pushes_back() {
        let (mut inbox, peer) = pair(4);
        for i in 0..4 {
            assert!(peer.push(7, i));
        }
        assert!(!peer.push(7, 99), "a full ring must refuse, not overwrite");
        assert_eq!(drain_all(&mut inbox), ((0..4).map(|i| (7, i)).collect(), 0));
        for lap in 0..10u32 {
            assert!(peer.push(8, lap) && peer.push(9, lap));
            assert_eq!(drain_all(&mut inbox).0, vec![(8, lap), (9, lap)]);
        }
    }

    #[test]
    fn concurrent_writers_deliver_every_entry_once() {
        let (mut inbox, _) = pair(64);
        let address = inbox.address();
        let writers: Vec<_> = (1..=4u32)
            .map(|w| {
                std::thread::spawn(move || {
                    let peer = PeerInbox::open(std::process::id(), &address).unwrap();
                    for i in 0..20_000u32 {
                        while !peer.push(w, i) {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u32; 5];
        let mut total = 0;
        while total < 80_000 {
            inbox.drain(1024, |tag, imm| {
                assert_eq!(imm, next[tag as usize], "writer {tag} out of order or duplicated");
                next[tag as usize] += 1;
                total += 1;
            });
        }
        for w in writers {
            w.join().unwrap();
        }
        assert_eq!(drain_all(&mut inbox), (vec![], 0));
    }

    #[test]
    fn garbage_is_refused_and_the_ring_keeps_working() {
        let (mut inbox, peer) = pair(8);
        let map = &peer.map;
        // A hostile peer: a slot with a wild sequence, then entries with forbidden tags.
        map.slot(0).store(pack(12345, 5, 5), Ordering::Release);
        map.slot(1).store(pack(2, 0, 1), Ordering::Release);
        map.slot(2).store(pack(3, CONTROL_TAG, 1), Ordering::Release);
        map.tail().store(3, Ordering::Release);
        assert!(peer.push(4, 4));
        let (got, refused) = drain_all(&mut inbox);
        assert_eq!((got, refused), (vec![(4, 4)], 3));
        // A wild tail hint only stalls writers (they report full), never the owner.
        map.tail().store(1 << 40, Ordering::Release);
        assert!(!peer.push(1, 1));
        map.tail().store(4, Ordering::Release);
        assert!(peer.push(1, 2));
        assert_eq!(drain_all(&mut inbox), (vec![(1, 2)], 0));
    }

    #[test]
    fn a_hole_punched_into_the_inbox_is_refused_not_a_crash() {
        let (mut inbox, peer) = pair(8);
        for i in 0..3 {
            assert!(peer.push(7, i));
        }
        assert_eq!(drain_all(&mut inbox).0.len(), 3);
        // SAFETY: plain syscall on the inbox's own descriptor; the pages then read as zeros.
        let punched = unsafe {
            libc::fallocate(
                inbox._fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                inbox_len(8) as libc::off_t,
            )
        };
        assert_eq!(punched, 0, "{}", std::io::Error::last_os_error());
        // Every zeroed slot at the read position is refused, one lap at most.
        let (got, refused) = drain_all(&mut inbox);
        assert_eq!((got, refused), (vec![], 8));
    }

    #[test]
    fn opening_anything_but_the_announced_inbox_fails() {
        let inbox = Inbox::create(16).unwrap();
        let a = inbox.address();
        let me = std::process::id();
        assert!(PeerInbox::open(me, &InboxAddress { nonce: a.nonce ^ 1, ..a }).is_err());
        assert!(PeerInbox::open(me, &InboxAddress { slots: 32, ..a }).is_err());
        assert!(PeerInbox::open(me, &InboxAddress { slots: 3, ..a }).is_err());
        // Descriptor 0 is not a memfd of ours.
        assert!(PeerInbox::open(me, &InboxAddress { fd: 0, ..a }).is_err());
        assert!(PeerInbox::open(u32::MAX, &a).is_err());
        assert!(Inbox::create(3).is_err() && Inbox::create(1 << 21).is_err());
    }
}
