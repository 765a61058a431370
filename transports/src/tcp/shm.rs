//! Shared memory between two ranks of one host: the segment file, its mapping, and the offer
//! made on the pair's first connection right after the handshake. The segment's layout and its
//! rings are core's ([`cohort_core::shm`]); serving a connection through them is
//! [`super::socket`]'s.
//!
//! # How a pair agrees
//!
//! The dialing side of a pair's first connection creates a segment under `/dev/shm` (a file
//! only its user may open, named after its pid and a random nonce) before the handshake, and
//! says so with the handshake's shared-memory flag; the accepting side sets the flag when it
//! allows shared memory at all. When both flags are set the dialer sends an
//! [`Offer`](cohort_core::shm::Offer) (its boot id, the nonce, the capacity, the file name);
//! the acceptor maps the file if it runs on the same boot of the same host and the segment's
//! header is the one offered, and answers. The dialer then removes the file either way: both
//! mappings live on, and nothing is left behind if either process dies later. A dialer killed
//! in the milliseconds between making the file and the answer leaves it behind; the next
//! segment made on the host removes such files once they are a minute old ([`sweep_stale`]).
//! Any refusal leaves the pair on TCP, which is always correct.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use cohort_core::shm::{ANSWER_LEN, Answer, Direction, OFFER_LEN, Offer, Segment, SegmentHeader, segment_len};
use cohort_core::work::{GroupId, Rank};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Where segment files are made.
const SHM_DIR: &str = "/dev/shm";

/// A shared segment both ranks of a pair have mapped, and this rank's side of it.
#[derive(Debug, Clone)]
pub(crate) struct ShmLink {
    pub(crate) segment: Segment,
    /// This rank created the segment (it writes ring 0 and reads ring 1).
    pub(crate) creator: bool,
}

impl ShmLink {
    /// The ring this rank writes.
    pub(crate) fn outgoing(&self) -> Direction {
        if self.creator { Direction::FromCreator } else { Direction::FromAcceptor }
    }

    /// The ring this rank reads.
    pub(crate) fn incoming(&self) -> Direction {
        if self.creator { Direction::FromAcceptor } else { Direction::FromCreator }
    }
}

/// This boot of this host, as the kernel names it.
fn boot_id() -> io::Result<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let hex: Vec<u8> = text.trim().bytes().filter(|&b| b != b'-').collect();
    let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("boot id {:?} is not a UUID", text.trim()));
    if hex.len() != 32 {
        return Err(bad());
    }
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).map_err(|_| bad())?;
        id[i] = u8::from_str_radix(s, 16).map_err(|_| bad())?;
    }
    Ok(id)
}

/// A mapping of a segment file (unmapped when the last [`Segment`] over it goes).
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; `Segment` governs every access to it.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is a mapping this struct made and nothing uses any more (every
        // `Segment` over it held an `Arc` of this).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn map(file: &File, len: usize, capacity: u64) -> io::Result<Segment> {
    // Populated now: the ring's pages are made while the pair connects, not by its first
    // transfers. SAFETY: a fresh shared mapping of the whole file; the kernel checks the
    // descriptor.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let mapping = Arc::new(Mapping { ptr: ptr.cast(), len });
    // SAFETY: the mapping is `len` bytes, page-aligned, readable and writable, and lives as long
    // as the owner; only `Segment`s (ours and the peer's) write it.
    unsafe { Segment::from_raw(mapping.ptr, len, capacity, mapping.clone()) }
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// Whether this process's threads take part in `membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)`
/// (registered once per process, where the kernel has it): its rings' producers then look at a
/// doorbell request without a fence, and its consumers run [`sleep_barrier`] before they sleep
/// ("Doorbells" in [`cohort_core::shm`]). A kernel without it, or a sandbox that refuses the
/// call, leaves the fences where they were.
pub(crate) fn in_barriers() -> bool {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REGISTERED.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            let need = (libc::MEMBARRIER_CMD_GLOBAL_EXPEDITED | libc::MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED)
                as libc::c_long;
            // SAFETY: plain system calls with no pointers: a query, then a registration.
            let cmds = unsafe { libc::syscall(libc::SYS_membarrier, libc::MEMBARRIER_CMD_QUERY, 0, 0) };
            cmds >= 0
                && cmds & need == need
                && unsafe { libc::syscall(libc::SYS_membarrier, libc::MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) }
                    == 0
        }
        #[cfg(not(target_os = "linux"))]
        false
    })
}

/// Make every running thread of every process that takes part ([`in_barriers`]) execute a
/// full fence: a consumer's barrier between its doorbell request and its last look. Only set
/// where [`in_barriers`] held, whose query found the command there; it then cannot fail.
pub(crate) fn sleep_barrier() {
    #[cfg(target_os = "linux")]
    // SAFETY: a plain system call with no pointers.
    unsafe {
        libc::syscall(libc::SYS_membarrier, libc::MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0);
    }
}

/// A segment this rank made and has not yet offered: the file is removed when this goes.
pub(crate) struct Created {
    segment: Segment,
    path: PathBuf,
    offer: Offer,
}

impl Drop for Created {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How old a segment file whose creator is gone must be before [`sweep_stale`] removes it. A
/// live creator removes its file within a handshake (at most `HANDSHAKE_TIMEOUT`, 10 s); the
/// margin covers a creator in another pid namespace sharing `/dev/shm`, whose pid this one
/// cannot see.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Remove segment files left in `dir` by creators that died between making a file and its
/// answer (a SIGKILL in those milliseconds): this user's `cohort-<pid>-<nonce>` files whose
/// process no longer exists and that are older than [`STALE_AFTER`]. Best effort: a file that
/// cannot be read or removed is left. Returns how many went.
fn sweep_stale(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let me = std::process::id();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(creator_pid) else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        let old = meta.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|age| age > STALE_AFTER);
        if pid == me || !old || !meta.is_file() || process_exists(pid) {
            continue;
        }
        if std::fs::remove_file(entry.path()).is_ok() {
            tracing::debug!(file = %entry.path().display(), pid, "removed a shared-memory segment its dead creator left");
            removed += 1;
        }
    }
    removed
}

/// The pid in a segment file's name (`cohort-<pid>-<16 hex digits>`), if it is one.
fn creator_pid(name: &str) -> Option<u32> {
    let (pid, nonce) = name.strip_prefix("cohort-")?.split_once('-')?;
    (nonce.len() == 16 && nonce.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
    pid.parse().ok()
}

/// Whether process `pid` exists (as this pid namespace sees it): a signal 0 reaches it, or is
/// refused for lack of permission (another user's process).
fn process_exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: signal 0 checks for the process and sends nothing.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Make a segment for the pair (`me` dials `peer` in group `gid`) with rings of `capacity` bytes.
pub(crate) fn create(me: Rank, peer: Rank, gid: GroupId, capacity: u64) -> io::Result<Created> {
    sweep_stale(std::path::Path::new(SHM_DIR));
    let boot_id = boot_id()?;
    let nonce = u64::from_le_bytes(crate::net::fresh_nonce()?.0[..8].try_into().expect("8 bytes"));
    let len = segment_len(capacity).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let name = format!("cohort-{}-{nonce:016x}", std::process::id());
    let path = PathBuf::from(SHM_DIR).join(&name);
    let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
    let offer = Offer { boot_id, nonce, capacity, name };
    let made = file.set_len(len as u64).and_then(|()| reserve(&file, len)).and_then(|()| map(&file, len, capacity));
    match made {
        Ok(segment) => {
            segment.init(&SegmentHeader { nonce, capacity, creator: me, acceptor: peer, group: gid });
            Ok(Created { segment, path, offer })
        }
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e)
        }
    }
}

/// Reserve the file's memory now: a `/dev/shm` too small for it (a container's 64 MiB, say)
/// then fails here, and the pair stays on TCP, instead of a write to the mapping dying of
/// SIGBUS later.
fn reserve(file: &File, len: usize) -> io::Result<()> {
    // SAFETY: a plain system call on a descriptor we own.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Map the segment `offer` names, if it is the one offered to `me` by `peer` in `gid`.
fn open(offer: &Offer, me: Rank, peer: Rank, gid: GroupId) -> Result<Segment, (Answer, String)> {
    match boot_id() {
        Ok(id) if id == offer.boot_id => {}
        Ok(_) => return Err((Answer::OtherHost, "another boot id".into())),
        Err(e) => return Err((Answer::OtherHost, format!("cannot read this host's boot id: {e}"))),
    }
    let path = PathBuf::from(SHM_DIR).join(&offer.name);
    let cannot = |e: io::Error| (Answer::CannotMap, format!("{}: {e}", path.display()));
    let file = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(&path).map_err(cannot)?;
    let meta = file.metadata().map_err(cannot)?;
    let len = segment_len(offer.capacity).map_err(|e| (Answer::Mismatch, e.to_string()))?;
    if !meta.is_file() || meta.len() != len as u64 {
        return Err((Answer::Mismatch, format!("{} is {} bytes, not the {len} offered", path.display(), meta.len())));
    }
    let segment = map(&file, len, offer.capacity).map_err(cannot)?;
    let want = SegmentHeader { nonce: offer.nonce, capacity: offer.capacity, creator: peer, acceptor: me, group: gid };
    match segment.header() {
        Ok(h) if h == want => Ok(segment),
        Ok(h) => Err((Answer::Mismatch, format!("header {h:?}, offered {want:?}"))),
        Err(e) => Err((Answer::Mismatch, e.to_string())),
    }
}

/// The dialer's side, after the handshake replies when both sides set the flag: offer the
/// segment, read the answer, remove the file. `Ok(None)`: the peer declined (logged).
pub(crate) async fn offer<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    created: Created,
    peer: Rank,
) -> io::Result<Option<ShmLink>> {
    stream.write_all(&created.offer.encode()).await?;
    stream.flush().await?;
    let mut answer = [0u8; ANSWER_LEN];
    stream.read_exact(&mut answer).await?;
    let answer = Answer::decode(&answer).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let segment = created.segment.clone();
    drop(created);
    if answer == Answer::Accept {
        Ok(Some(ShmLink { segment, creator: true }))
    } else {
        tracing::debug!(%peer, "no shared memory with rank {peer}: {answer}");
        Ok(None)
    }
}

/// The acceptor's side: read the offer, map the segment if it is ours to share, answer.
/// `Ok(None)`: declined (logged); `Err`: the connection is unusable (an offer whose length
/// cannot be read leaves the stream at an unknown place).
pub(crate) async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    me: Rank,
    peer: Rank,
    gid: GroupId,
) -> io::Result<Option<ShmLink>> {
    let mut fixed = [0u8; OFFER_LEN];
    stream.read_exact(&mut fixed).await?;
    let invalid = |e: cohort_core::shm::ShmError| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
    let len = match Offer::name_len(&fixed) {
        Ok(len) => len,
        Err(e) => {
            let _ = stream.write_all(&Answer::BadOffer.encode()).await;
            return Err(invalid(e));
        }
    };
    let mut name = vec![0u8; len];
    stream.read_exact(&mut name).await?;
    let result = match Offer::decode(&fixed, &name) {
        Ok(offer) => open(&offer, me, peer, gid),
        Err(e) => Err((Answer::BadOffer, e.to_string())),
    };
    let (reply, link) = match result {
        Ok(segment) => (Answer::Accept, Some(ShmLink { segment, creator: false })),
        Err((answer, why)) => {
            tracing::debug!(%peer, "declined rank {peer}'s shared memory ({answer}): {why}");
            (answer, None)
        }
    };
    stream.write_all(&reply.encode()).await?;
    stream.flush().await?;
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pair_agrees_on_a_segment_and_the_file_is_gone_after() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let created = create(Rank(0), Rank(1), GroupId(3), 1 << 16).unwrap();
        let path = created.path.clone();
        assert!(path.exists());
        let (mine, theirs) =
            tokio::join!(offer(&mut a, created, Rank(1)), answer(&mut b, Rank(1), Rank(0), GroupId(3)));
        let (mine, theirs) = (mine.unwrap().unwrap(), theirs.unwrap().unwrap());
        assert!(!path.exists(), "removed once answered");
        let mut p = mine.segment.producer(mine.outgoing());
        let mut c = theirs.segment.consumer(theirs.incoming());
        assert_eq!(p.write([&b"across"[..]]).unwrap(), 6);
        let mut out = [0u8; 16];
        assert_eq!(c.read(&mut out).unwrap(), 6);
        assert_eq!(&out[..6], b"across");
    }

    #[tokio::test]
    async fn an_offer_for_someone_else_or_another_host_is_declined() {
        // Offered to rank 1 of group 3; rank 2 answers.
        let (mut a, mut b) = tokio::io::duplex(4096);
        let created = create(Rank(0), Rank(1), GroupId(3), 1 << 16).unwrap();
        let (mine, theirs) =
            tokio::join!(offer(&mut a, created, Rank(2)), answer(&mut b, Rank(2), Rank(0), GroupId(3)));
        assert!(mine.unwrap().is_none() && theirs.unwrap().is_none());
        // Another boot id.
        let created = create(Rank(0), Rank(1), GroupId(3), 1 << 16).unwrap();
        let mut offer = created.offer.clone();
        offer.boot_id[0] ^= 1;
        assert_eq!(open(&offer, Rank(1), Rank(0), GroupId(3)).unwrap_err().0, Answer::OtherHost);
        // A name that is no file.
        let offer = Offer { name: "cohort-no-such-segment".into(), ..created.offer.clone() };
        assert_eq!(open(&offer, Rank(1), Rank(0), GroupId(3)).unwrap_err().0, Answer::CannotMap);
        // Another capacity than the file has.
        let offer = Offer { capacity: 1 << 17, ..created.offer.clone() };
        assert_eq!(open(&offer, Rank(1), Rank(0), GroupId(3)).unwrap_err().0, Answer::Mismatch);
    }

    #[test]
    fn files_a_dead_creator_left_are_swept_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("cohort-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let live = std::process::id();
        let long_ago = std::time::SystemTime::now() - STALE_AFTER * 2;
        let file = |name: String, old: bool| {
            let path = dir.join(name);
            let f = File::create(&path).unwrap();
            if old {
                f.set_modified(long_ago).unwrap();
            }
            path
        };
        let stale = file(format!("cohort-{dead}-0123456789abcdef"), true);
        let young = file(format!("cohort-{dead}-fedcba9876543210"), false);
        let alive = file(format!("cohort-{live}-0123456789abcdef"), true);
        let other = file(format!("cohort-{dead}-not-a-nonce"), true);
        assert_eq!(sweep_stale(&dir), 1);
        assert!(!stale.exists(), "an old file of a dead creator goes");
        assert!(young.exists(), "a young one stays: its creator may be in another pid namespace");
        assert!(alive.exists(), "a live creator's stays");
        assert!(other.exists(), "a name that is not a segment's stays");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(creator_pid("cohort-12-0123456789abcdef"), Some(12));
        assert_eq!(creator_pid("cohort-x-0123456789abcdef"), None);
        assert_eq!(creator_pid("other-12-0123456789abcdef"), None);
    }

    #[tokio::test]
    async fn a_malformed_offer_is_answered_and_fails_the_connection() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        a.write_all(&[0xAB; OFFER_LEN]).await.unwrap();
        let e = answer(&mut b, Rank(1), Rank(0), GroupId(0)).await.unwrap_err();
        assert!(e.to_string().contains("malformed shared-memory offer"), "{e}");
        let mut reply = [0u8; ANSWER_LEN];
        a.read_exact(&mut reply).await.unwrap();
        assert_eq!(Answer::decode(&reply).unwrap(), Answer::BadOffer);
    }
}
