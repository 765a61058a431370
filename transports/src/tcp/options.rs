//! Options of the TCP backend, and reading them from the environment.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use cohort_core::group::{DEFAULT_TIMEOUT, ErrorHandling, HeartbeatConfig};

use crate::env::{self, Env};

/// Options of a TCP process group (what `ProcessGroupGloo::Options` holds, plus cohort's
/// failure detection). Every field has a documented default and most have an environment
/// variable, read by [`TcpOptions::from_env`].
#[derive(Debug, Clone, PartialEq)]
pub struct TcpOptions {
    /// Default timeout of every collective (Gloo's 30 minutes). `COHORT_TIMEOUT_MS` (collectives
    /// only, as under NCCL: it does not change `init_timeout`).
    pub timeout: Duration,
    /// How long connecting to every peer may take. `COHORT_INIT_TIMEOUT_MS`, default 300 s.
    pub init_timeout: Duration,
    /// Peer heartbeats; `None` turns them off. `COHORT_HEARTBEAT_MS` (interval, default 1000;
    /// 0 turns heartbeats off) and `COHORT_PEER_DEAD_AFTER_MS` (default 10000).
    pub heartbeat: Option<HeartbeatConfig>,
    /// What to do after a failure, as `TORCH_NCCL_ASYNC_ERROR_HANDLING`.
    /// `COHORT_ASYNC_ERROR_HANDLING` (or `TORCH_NCCL_ASYNC_ERROR_HANDLING`, 0-3), default 2
    /// (clean up only).
    pub error_handling: ErrorHandling,
    /// The address to listen on and publish to peers. `COHORT_SOCKET_IFNAME` names an interface
    /// (as `GLOO_SOCKET_IFNAME`); without it, the address the host name resolves to, falling
    /// back to loopback with a warning.
    pub bind_addr: IpAddr,
    /// Largest frame payload accepted from a peer. Default 1 GiB.
    pub max_frame: u64,
    /// TCP connections each rank writes its large data frames to a peer on (1 to
    /// [`MAX_CONNECTIONS_PER_PEER`]), round robin. A pair of ranks opens twice as many, one set
    /// per direction, so that the two ranks' bulk writes never share a socket; control frames,
    /// point-to-point messages and small data frames go both ways on the pair's first
    /// connection, so their order holds. Every rank must use the same number (the handshake
    /// checks it). Under `lazy_connect`, each rank that dials opens one set and writes on it.
    /// `COHORT_CONNECTIONS_PER_PEER`, default 1.
    pub connections_per_peer: u16,
    /// Connect to a peer on first use rather than to every peer at init (Gloo's lazy init,
    /// `TORCH_GLOO_LAZY_INIT`): init only waits until every rank has published its address, and
    /// a job whose ranks talk to few peers (a ring, a pipeline) opens few connections. A peer's
    /// heartbeats and silence watch start once it is connected. `COHORT_LAZY_INIT` (or
    /// `TORCH_GLOO_LAZY_INIT`) = 1, default off.
    pub lazy_connect: bool,
    /// Works the data plane may run at once. Default 64.
    pub max_in_flight: usize,
    /// Bytes of large-chunk buffers (receive buffers, and copies of chunks queued for a
    /// writer) the group keeps for reuse, counting those in use. A collective that receives
    /// large chunks reserves buffers for everything it receives, up to this, when it starts:
    /// made and written at once, and then kept, so that a later collective of its size maps no
    /// new memory (on the 2-core VM, new pages during a 64 MiB allreduce made one iteration in
    /// ten or so take 2-3 times as long). The memory is held until the group ends.
    /// `COHORT_BUFFER_POOL_MB`, default 64 (0 keeps nothing: every chunk gets a new buffer).
    pub buffer_pool_bytes: usize,
    /// How long a thread waiting for a work of at most [`BUSY_POLL_MAX_BYTES`] reads the
    /// sockets itself before it sleeps: the frame that finishes the work then wakes nobody.
    /// Zero turns it off (every wait sleeps at once). `COHORT_BUSY_POLL_US`, default 50.
    pub busy_poll: Duration,
    /// This host runs more ranks than it has cores (`LOCAL_WORLD_SIZE`, set by `cohort launch`,
    /// torchrun and `cohort bench`, says so): a polling thread then yields its core after
    /// every empty poll, as MPI does when oversubscribed, so that the rank whose frame it waits
    /// for runs at once, and moves to a less crowded core when its own holds more than its
    /// share of the polling threads of the ranks it shares memory with; otherwise it spins
    /// between yields 20 µs apart.
    pub oversubscribed: bool,
    /// On an oversubscribed host, the core the worker threads of the runtime that
    /// [`init_process_group`](super::init_process_group) builds ([`runtime`](super::runtime),
    /// which `cohort_torch` uses too) keep to, counted round the cores
    /// this process may use: this rank's `LOCAL_RANK`, so that the host's ranks' threads, which
    /// write a large collective's frames, are spread evenly (left to the
    /// kernel, four ranks' threads on two cores spent long stretches three or four to a core:
    /// `docs/performance.md`, "The runtime's threads kept to their rank's core"). `None`: they
    /// run where the kernel puts them, as do the caller's threads always. Set from the
    /// environment when `oversubscribed`; `COHORT_PIN_IO_THREADS=0` turns it off.
    pub io_core: Option<usize>,
    /// Where the host's ranks have a core each (`LOCAL_WORLD_SIZE` of at least 2, and at most
    /// the cores): this rank's `LOCAL_RANK`, the core (counted round the cores this process may
    /// use) its polling thread goes to when it finds another polling thread on its own core or
    /// wakes on another, so that of two ranks' threads on one core exactly one leaves, and for a
    /// core of its own. It is never kept there: the kernel may move it as it likes. Used where
    /// no peer says where its thread runs (peers over sockets: see
    /// `crate::work::Neighbours`), and only where this process may use every core of the host,
    /// so that the ranks' cores differ (`crate::work::home_core`). `None`: a coin decides which
    /// of the two moves.
    pub home_core: Option<usize>,
    /// Worker threads of the tokio runtime that [`init_process_group`](super::init_process_group)
    /// builds for the group: they run the reader, writer and timer tasks (a group made with
    /// `ProcessGroup::connect` runs on the caller's runtime and ignores this). One is enough
    /// where waiting threads read small works themselves (see `busy_poll`), and on a host whose
    /// cores the ranks already fill, a second only adds hand-offs between the two (2 ranks on
    /// 2 cores: 16 zero-element works in flight 12.0 → 9.6 µs per work, 1 MiB allreduce
    /// 359 → 292 µs). More may pay for large transfers with many peers on a host with cores to
    /// spare. `COHORT_IO_THREADS`, default 1.
    pub io_threads: usize,
    /// Flight-recorder entries kept (0 turns it off). `COHORT_TRACE_BUFFER_SIZE` (or
    /// `TORCH_NCCL_TRACE_BUFFER_SIZE`); default 2000.
    pub trace_buffer_size: usize,
    /// Where to dump the flight recorder when the group fails: `<prefix><rank>.json`.
    /// `COHORT_DUMP_ON_FAILURE` (or `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`: a file prefix); off by
    /// default.
    pub dump_prefix: Option<PathBuf>,
    /// The Unix time (ns) the flight recorder's timestamps count from, read from the system
    /// clock at init when `None` (the default). The simulator sets it so that dumps are the
    /// same bytes on every replay of a seed.
    pub wall_clock_anchor_ns: Option<u64>,
    /// The job's shared secret: with one, every connection between ranks proves in both
    /// directions that its other end knows it (challenge-response; the secret never crosses
    /// the wire), and a peer that cannot is refused on both sides with an error naming it.
    /// `COHORT_AUTH_TOKEN`, or the contents of the file `COHORT_AUTH_TOKEN_FILE` names; none
    /// by default.
    pub auth: Option<cohort_core::protocol::AuthSecret>,
    /// Between two ranks of one host, frames go through a shared-memory segment instead of
    /// the socket (see `shm.rs`): the pair's first connection agrees on it when both ranks
    /// allow it, and stays open as the liveness channel and for doorbells. Only real sockets
    /// share memory (the simulator's never do). `COHORT_SHM`, default 1 (0 turns it off).
    pub shared_memory: bool,
    /// Each direction's ring in a pair's shared-memory segment, in bytes (a power of two from
    /// 4 KiB to 1 GiB): room for a few of the large chunks a collective streams, so that a
    /// writer rarely waits for its reader. The default depends on the ranks a host
    /// (`LOCAL_WORLD_SIZE`): 4 MiB up to 2, 2 MiB up to 8, else 32 MiB divided among them (at
    /// least 256 KiB): smaller rings stay in cache (see `shm_ring_bytes`). The segment's
    /// memory is reserved when the pair connects (twice this).
    pub shm_ring_bytes: u64,
    /// Over shared memory, an allreduce of up to 4 KiB in a world of a power of two ranks (2,
    /// 4, 8…) with nothing else in flight runs in its submit call: the submitting thread sends
    /// its frame to each peer of its recursive-doubling chain in turn, waits briefly for the
    /// peer's and reduces it where it lies, under the same bookkeeping as any work; anything
    /// unusual hands it to the usual path (see `quick.rs`). `COHORT_SHM_QUICK`, default 1 (0
    /// turns it off).
    pub shm_quick: bool,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: DEFAULT_TIMEOUT,
            init_timeout: Duration::from_secs(300),
            heartbeat: Some(HeartbeatConfig::default()),
            error_handling: ErrorHandling::default(),
            bind_addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
            max_frame: 1 << 30,
            connections_per_peer: 1,
            lazy_connect: false,
            max_in_flight: 64,
            buffer_pool_bytes: super::link::BufferPool::DEFAULT_LIMIT,
            busy_poll: Duration::from_micros(50),
            oversubscribed: false,
            io_core: None,
            home_core: None,
            io_threads: 1,
            trace_buffer_size: 2000,
            dump_prefix: None,
            wall_clock_anchor_ns: None,
            auth: None,
            shared_memory: true,
            shm_ring_bytes: shm_ring_bytes(1),
            shm_quick: true,
        }
    }
}

/// Largest work (its tensors' bytes, inputs and outputs) whose waiter busy-polls (see
/// [`TcpOptions::busy_poll`]). Up to this size, a waiting thread that reduces and forwards the
/// chunks itself beats handing them between the runtime's tasks (2 ranks on loopback: 256 KiB,
/// 1 MiB and 4 MiB allreduces all faster); above it, one op's time dwarfs the wake-ups saved.
pub const BUSY_POLL_MAX_BYTES: usize = 8 * 1024 * 1024;

/// The default [`TcpOptions::shm_ring_bytes`] for `local` ranks on the host.
///
/// A ring's bytes are written and read in turn, cycling through all of it, so the smaller the
/// ring the more of it is still in cache when its bytes come round again. With more than two
/// ranks a host the rings (each rank writes one and reads another in a ring collective)
/// outgrow the cache and the smaller ring is faster; with two, the larger one lets a writer of
/// large chunks wait less for room (`docs/performance.md`, "Ring size").
fn shm_ring_bytes(local: u64) -> u64 {
    if local <= 2 {
        return 4 << 20;
    }
    if local <= 8 {
        return 2 << 20;
    }
    // 32 MiB among the ranks, rounded down to a power of two.
    let share = (32u64 << 20) / local;
    (1u64 << (63 - share.max(1).leading_zeros())).max(256 << 10)
}

/// Most runtime worker threads [`TcpOptions::io_threads`] may ask for.
pub const MAX_IO_THREADS: usize = 64;

/// Most connections a pair of ranks may open.
pub const MAX_CONNECTIONS_PER_PEER: u16 = 16;

pub use crate::env::EnvError;

impl TcpOptions {
    /// Defaults, overridden by whatever `COHORT_*` variables (or their torch names) are set; a
    /// malformed value is an error naming the variable. `COHORT_TIMEOUT_MS` sets the collective
    /// timeout only; the init timeout is `COHORT_INIT_TIMEOUT_MS`.
    pub fn from_env() -> Result<TcpOptions, EnvError> {
        Self::from_vars(&Env::process())
    }

    /// [`TcpOptions::from_env`] over any source of variables.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<TcpOptions, EnvError> {
        Self::from_vars(&Env::new(lookup))
    }

    fn from_vars<F: Fn(&str) -> Option<String>>(v: &Env<F>) -> Result<TcpOptions, EnvError> {
        let mut o = TcpOptions::default();
        if let Some(t) = v.millis(env::TIMEOUT_MS)? {
            o.timeout = t;
        }
        if let Some(t) = v.millis(env::INIT_TIMEOUT_MS)? {
            o.init_timeout = t;
        }
        let interval = v.millis(env::HEARTBEAT_MS)?;
        let dead_after = v.millis(env::PEER_DEAD_AFTER_MS)?;
        o.heartbeat = match interval {
            Some(Duration::ZERO) => None,
            _ => {
                let d = HeartbeatConfig::default();
                Some(HeartbeatConfig {
                    interval: interval.unwrap_or(d.interval),
                    dead_after: dead_after.unwrap_or(d.dead_after),
                })
            }
        };
        if let Some(level) = v.error_handling()? {
            o.error_handling = level;
        }
        if let Some(t) = v.micros(env::BUSY_POLL_US)? {
            o.busy_poll = t;
        }
        let local = v.u64(env::LOCAL_WORLD_SIZE)?.unwrap_or(1);
        o.shm_ring_bytes = shm_ring_bytes(local);
        o.oversubscribed = local > std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        let slot = v.u64(env::LOCAL_RANK)?;
        if o.oversubscribed && v.flag(env::PIN_IO_THREADS)?.unwrap_or(true) {
            o.io_core = Some(usize::try_from(slot.unwrap_or(0)).unwrap_or(usize::MAX));
        }
        if local > 1 && !o.oversubscribed {
            o.home_core = slot.and_then(|s| usize::try_from(s).ok());
        }
        if let Some(n) = v.u64(env::IO_THREADS)? {
            o.io_threads = io_threads(n)?;
        }
        if let Some(mb) = v.u64(env::BUFFER_POOL_MB)? {
            o.buffer_pool_bytes = buffer_pool_bytes(mb)?;
        }
        if let Some(n) = v.u64(env::TRACE_BUFFER_SIZE)? {
            o.trace_buffer_size = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(n) = v.u64(env::CONNECTIONS_PER_PEER)? {
            o.connections_per_peer =
                u16::try_from(n).ok().filter(|n| (1..=MAX_CONNECTIONS_PER_PEER).contains(n)).ok_or_else(|| {
                    EnvError::invalid(
                        env::CONNECTIONS_PER_PEER.name(),
                        n.to_string(),
                        format!("expected 1 to {MAX_CONNECTIONS_PER_PEER}"),
                    )
                })?;
        }
        if let Some(b) = v.flag(env::LAZY_INIT)? {
            o.lazy_connect = b;
        }
        if let Some(b) = v.flag(env::SHM)? {
            o.shared_memory = b;
        }
        if let Some(b) = v.flag(env::SHM_QUICK)? {
            o.shm_quick = b;
        }
        o.dump_prefix = v.path(env::DUMP_ON_FAILURE);
        o.auth = v.auth_secret()?;
        o.bind_addr = resolve_bind_addr(v.string(env::SOCKET_IFNAME).as_deref())?;
        Ok(o)
    }
}

/// `COHORT_IO_THREADS`, checked.
fn io_threads(n: u64) -> Result<usize, EnvError> {
    usize::try_from(n).ok().filter(|n| (1..=MAX_IO_THREADS).contains(n)).ok_or_else(|| {
        EnvError::invalid(env::IO_THREADS.name(), n.to_string(), format!("expected 1 to {MAX_IO_THREADS}"))
    })
}

/// `COHORT_BUFFER_POOL_MB`, in bytes.
fn buffer_pool_bytes(mb: u64) -> Result<usize, EnvError> {
    usize::try_from(mb).ok().and_then(|mb| mb.checked_mul(1 << 20)).filter(|&b| b <= isize::MAX as usize).ok_or_else(
        || EnvError::invalid(env::BUFFER_POOL_MB.name(), mb.to_string(), "more bytes than this host can address"),
    )
}

/// The address to bind: the named interface's, else the host name's, else loopback.
pub fn resolve_bind_addr(ifname: Option<&str>) -> Result<IpAddr, EnvError> {
    if let Some(name) = ifname {
        return interface_addr(name).ok_or_else(|| {
            EnvError::invalid(env::SOCKET_IFNAME.name(), name, "no such interface with an IPv4 address")
        });
    }
    if let Some(addr) = hostname_addr() {
        return Ok(addr);
    }
    tracing::warn!(
        "the host name does not resolve to a usable address; binding to loopback (set COHORT_SOCKET_IFNAME to choose an interface)"
    );
    Ok(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn hostname_addr() -> Option<IpAddr> {
    use std::net::ToSocketAddrs;
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let host = std::str::from_utf8(&buf[..end]).ok()?;
    (host, 0).to_socket_addrs().ok()?.map(|a| a.ip()).find(|ip| ip.is_ipv4())
}

fn interface_addr(name: &str) -> Option<IpAddr> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_name.is_null() || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated C string owned by the list.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr is non-null and points at a sockaddr of the family it states.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if ifname.to_bytes() == name.as_bytes() && family == libc::AF_INET {
            // SAFETY: the family is AF_INET, so the sockaddr is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
            break;
        }
    }
    // SAFETY: ifap came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|&(n, v)| (n.to_owned(), v.to_owned())).collect();
        move |name: &str| pairs.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn shared_memory_rings_shrink_on_hosts_with_many_ranks() {
        let ring = |local: &str| {
            TcpOptions::from_lookup(|k| (k == "LOCAL_WORLD_SIZE").then(|| local.to_owned())).unwrap().shm_ring_bytes
        };
        assert_eq!(TcpOptions::default().shm_ring_bytes, 4 << 20);
        assert_eq!(ring("2"), 4 << 20);
        assert_eq!(ring("3"), 2 << 20);
        assert_eq!(ring("8"), 2 << 20);
        assert_eq!(ring("12"), 2 << 20);
        assert_eq!(ring("16"), 2 << 20);
        assert_eq!(ring("64"), 512 << 10);
        assert_eq!(ring("1000"), 256 << 10);
        let off = TcpOptions::from_lookup(|k| (k == "COHORT_SHM").then(|| "0".to_owned())).unwrap();
        assert!(!off.shared_memory && TcpOptions::default().shared_memory);
    }

    #[test]
    fn more_local_ranks_than_cores_keeps_each_ranks_io_threads_to_its_local_ranks_core() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let crowded = (cores + 1).to_string();
        let with = |extra: &[(&str, &str)]| {
            let mut pairs = vec![("LOCAL_WORLD_SIZE", crowded.as_str())];
            pairs.extend_from_slice(extra);
            TcpOptions::from_lookup(table(&pairs))
        };
        assert_eq!(with(&[("LOCAL_RANK", "3")]).unwrap().io_core, Some(3));
        assert_eq!(with(&[]).unwrap().io_core, Some(0), "no LOCAL_RANK: the first core");
        assert_eq!(with(&[("LOCAL_RANK", "3"), ("COHORT_PIN_IO_THREADS", "0")]).unwrap().io_core, None);
        let e = with(&[("LOCAL_RANK", "3"), ("COHORT_PIN_IO_THREADS", "sometimes")]).unwrap_err();
        assert!(e.to_string().contains("COHORT_PIN_IO_THREADS"), "{e}");
        let e = with(&[("LOCAL_RANK", "third")]).unwrap_err();
        assert!(e.to_string().contains("LOCAL_RANK"), "{e}");
        let uncrowded = TcpOptions::from_lookup(table(&[("LOCAL_WORLD_SIZE", "1"), ("LOCAL_RANK", "0")])).unwrap();
        assert_eq!(uncrowded.io_core, None, "a core each: the kernel places them");
        assert_eq!(TcpOptions::default().io_core, None);
        assert_eq!(with(&[("LOCAL_RANK", "3")]).unwrap().home_core, None, "no core each: no home either");
    }

    #[test]
    fn where_the_local_ranks_have_a_core_each_the_local_rank_names_the_polling_threads_home() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let local = |world: usize, rank: Option<&str>| {
            let world = world.to_string();
            let mut pairs = vec![("LOCAL_WORLD_SIZE", world.as_str())];
            pairs.extend(rank.map(|r| ("LOCAL_RANK", r)));
            TcpOptions::from_lookup(table(&pairs)).unwrap().home_core
        };
        if cores >= 2 {
            assert_eq!(local(2, Some("1")), Some(1));
            assert_eq!(local(cores, Some("0")), Some(0));
        }
        assert_eq!(local(1, Some("0")), None, "alone on the host: no peer to meet");
        assert_eq!(local(2, None), None, "no LOCAL_RANK: nothing tells the ranks apart");
        assert_eq!(local(cores + 1, Some("1")), None, "more ranks than cores");
        assert_eq!(TcpOptions::default().home_core, None);
    }

    #[test]
    fn more_local_ranks_than_cores_keeps_polling_but_yields_at_every_poll() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let crowded = (cores + 1).to_string();
        let o = TcpOptions::from_lookup(table(&[("LOCAL_WORLD_SIZE", crowded.as_str())])).unwrap();
        assert!(o.oversubscribed);
        assert_eq!(o.busy_poll, Duration::from_micros(50), "polling stays on");
        let o = TcpOptions::from_lookup(table(&[("LOCAL_WORLD_SIZE", "1")])).unwrap();
        assert!(!o.oversubscribed);
        let o = TcpOptions::from_lookup(table(&[("LOCAL_WORLD_SIZE", crowded.as_str()), ("COHORT_BUSY_POLL_US", "0")]))
            .unwrap();
        assert_eq!(o.busy_poll, Duration::ZERO, "the variable still turns it off");
    }

    #[test]
    fn the_timeout_variable_sets_the_collective_timeout_only() {
        let o = TcpOptions::from_lookup(table(&[("COHORT_TIMEOUT_MS", "1500")])).unwrap();
        assert_eq!(o.timeout, Duration::from_millis(1500));
        assert_eq!(o.init_timeout, TcpOptions::default().init_timeout);
        let o = TcpOptions::from_lookup(table(&[("COHORT_INIT_TIMEOUT_MS", "700")])).unwrap();
        assert_eq!((o.timeout, o.init_timeout), (DEFAULT_TIMEOUT, Duration::from_millis(700)));
    }

    #[test]
    fn options_read_every_name_and_the_torch_aliases() {
        let o = TcpOptions::from_lookup(table(&[
            ("COHORT_HEARTBEAT_MS", "0"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("COHORT_BUSY_POLL_US", "9"),
            ("COHORT_IO_THREADS", "2"),
            ("COHORT_BUFFER_POOL_MB", "1"),
            ("TORCH_NCCL_TRACE_BUFFER_SIZE", "5"),
            ("COHORT_CONNECTIONS_PER_PEER", "4"),
            ("TORCH_GLOO_LAZY_INIT", "1"),
            ("COHORT_DUMP_ON_FAILURE", "/tmp/fr_"),
            ("COHORT_SOCKET_IFNAME", "lo"),
        ]))
        .unwrap();
        assert_eq!(o.heartbeat, None);
        assert_eq!(o.error_handling, ErrorHandling::from_level(1).unwrap());
        assert_eq!(o.busy_poll, Duration::from_micros(9));
        assert_eq!((o.io_threads, o.buffer_pool_bytes, o.trace_buffer_size), (2, 1 << 20, 5));
        assert_eq!(o.connections_per_peer, 4);
        assert!(o.lazy_connect);
        assert_eq!(o.dump_prefix, Some(PathBuf::from("/tmp/fr_")));
        assert_eq!(o.bind_addr, IpAddr::V4(Ipv4Addr::LOCALHOST));
        let o = TcpOptions::from_lookup(table(&[("COHORT_HEARTBEAT_MS", "20"), ("COHORT_PEER_DEAD_AFTER_MS", "90")]))
            .unwrap();
        let hb = o.heartbeat.unwrap();
        assert_eq!((hb.interval, hb.dead_after), (Duration::from_millis(20), Duration::from_millis(90)));
    }

    #[test]
    fn malformed_values_are_errors_naming_the_variable() {
        for (name, value, reason) in [
            ("COHORT_TIMEOUT_MS", "10s", "invalid digit found in string"),
            ("LOCAL_WORLD_SIZE", "two", "invalid digit found in string"),
            ("COHORT_LAZY_INIT", "maybe", "expected 1 or 0"),
            ("COHORT_CONNECTIONS_PER_PEER", "0", "expected 1 to 16"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "7", "expected 0 (no handling)"),
        ] {
            let e = TcpOptions::from_lookup(table(&[(name, value)])).unwrap_err();
            assert_eq!(e.name(), name);
            assert!(
                e.to_string().starts_with(&format!("environment variable {name}={value:?} is invalid: {reason}")),
                "{e}"
            );
        }
    }

    #[test]
    fn io_threads_default_to_one_and_refuse_zero_or_too_many() {
        assert_eq!(TcpOptions::default().io_threads, 1);
        assert_eq!(io_threads(3), Ok(3));
        assert_eq!(io_threads(MAX_IO_THREADS as u64), Ok(MAX_IO_THREADS));
        for bad in [0, MAX_IO_THREADS as u64 + 1] {
            let err = io_threads(bad).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("environment variable COHORT_IO_THREADS=\"{bad}\" is invalid: expected 1 to 64")
            );
        }
    }

    #[test]
    fn the_buffer_pool_holds_64_mib_unless_told_and_refuses_what_cannot_be_addressed() {
        assert_eq!(TcpOptions::default().buffer_pool_bytes, 64 << 20);
        assert_eq!(buffer_pool_bytes(0), Ok(0));
        assert_eq!(buffer_pool_bytes(3), Ok(3 << 20));
        let err = buffer_pool_bytes(u64::MAX).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "environment variable COHORT_BUFFER_POOL_MB=\"{}\" is invalid: more bytes than this host can address",
                u64::MAX
            )
        );
    }

    #[test]
    fn loopback_interface_resolves_and_unknown_ones_are_named() {
        assert_eq!(resolve_bind_addr(Some("lo")).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        let err = resolve_bind_addr(Some("no-such-if0")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment variable COHORT_SOCKET_IFNAME=\"no-such-if0\" is invalid: no such interface with an IPv4 address"
        );
    }
}
