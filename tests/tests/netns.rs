//! Partitions on real kernel sockets: 4 `cohort-rank` processes, each in a Linux network
//! namespace of its own, joined by bridges in a switch namespace; the test drops every packet
//! across a link with `tc` and checks whom each rank's work error blames.
//!
//! The switch namespace holds two side bridges (`sa` for ranks 0 and 1, `sb` for ranks 2 and
//! 3) joined by a trunk veth pair (`ta`–`tb`). Rank r's `eth0` is paired with `h<r>` in a leaf
//! bridge `l<r>`, which an uplink pair (`u<r>`–`d<r>`) joins to its side bridge:
//!
//! ```text
//!  r0:eth0─h0[l0]u0──d0┐            ┌d2──u2[l2]h2─eth0:r2
//!                      [sa]ta────tb[sb]
//!  r1:eth0─h1[l1]u1──d1┘            └d3──u3[l3]h3─eth0:r3
//! ```
//!
//! Every link the test cuts is a veth pair with a bridge on both ends, so the dropped packets
//! are forwarded ones: they vanish on the way, as in a real network, and no sender's own
//! interface reports a drop to its TCP stack. A cut is a qdisc that drops everything on both
//! ends of the pair: `netem loss 100%`, or, on a kernel without `sch_netem`, `pfifo limit 0`
//! (a queue of length 0 drops every packet it is given).
//!
//! Rank 0 hosts the store (`MASTER_ADDR` is its address). The ranks allreduce in a loop
//! (heartbeats every 100 ms, a peer silent for 1 s is lost, collectives time out after 60 s),
//! the test cuts the network and tells them to go on, and each rank prints its first failure
//! (`netns-error via=… blame=<Blame::encode> :: <error text>`).
//!
//! It needs root, `ip` and `tc`. Where it cannot run, it says why (`SKIPPED: …` on stderr);
//! with `COHORT_REQUIRE_NETNS=1` (CI, as root) a skip is a failure.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cohort_core::{Blame, Rank};

const WORLD: u32 = 4;
const PORT: &str = "29500";

// ---- skipping ----

/// Say why the test cannot run, and fail instead where `COHORT_REQUIRE_NETNS=1`.
fn skip(reason: &str) {
    if std::env::var("COHORT_REQUIRE_NETNS").is_ok_and(|v| v == "1") {
        panic!("COHORT_REQUIRE_NETNS=1, but the network-namespace test cannot run: {reason}");
    }
    eprintln!("SKIPPED: {reason} (set COHORT_REQUIRE_NETNS=1 to make this a failure)");
}

/// `name` on `PATH`, or in `/usr/sbin` or `/sbin` (often off a non-root `PATH`).
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

struct Tools {
    ip: PathBuf,
    tc: PathBuf,
}

/// The tools, if this process can make namespaces, veth pairs and bridges; else why not.
/// `tag` names the scenario (its probe namespace is its own: the tests run in parallel).
fn can_run(tag: &str) -> Result<Tools, String> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(format!("not root (euid {euid}): creating network namespaces needs root"));
    }
    let ip = find_tool("ip").ok_or("`ip` (iproute2) is not on PATH, nor in /usr/sbin or /sbin")?;
    let tc = find_tool("tc").ok_or("`tc` (iproute2) is not on PATH, nor in /usr/sbin or /sbin")?;
    let probe = format!("{}-{tag}-probe", prefix());
    run(&ip, &["netns", "add", &probe]).map_err(|e| format!("cannot create a network namespace: {e}"))?;
    let made = run(&ip, &["-n", &probe, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1"])
        .map_err(|e| format!("cannot make a veth pair in a namespace: {e}"))
        .and_then(|()| {
            run(&ip, &["-n", &probe, "link", "add", "name", "pb", "type", "bridge"])
                .map_err(|e| format!("cannot make a bridge in a namespace: {e}"))
        });
    let _ = run(&ip, &["netns", "del", &probe]);
    made.map(|()| Tools { ip, tc })
}

// ---- namespaces ----

/// This process's namespaces start with it (and stale ones of dead processes are found by it).
fn prefix() -> String {
    format!("cohort-nt-{}", std::process::id())
}

fn run(tool: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new(tool).args(args).output().map_err(|e| format!("{}: {e}", tool.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{} {}` failed ({}): {}",
            tool.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must(tool: &Path, args: &[&str]) {
    if let Err(e) = run(tool, args) {
        panic!("{e}");
    }
}

/// Remove namespaces a killed earlier run left behind (its process is gone).
fn remove_stale(ip: &Path) {
    let Ok(out) = Command::new(ip).args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name.strip_prefix("cohort-nt-").and_then(|r| r.split('-').next()) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!("removing stale namespace {name}");
            let _ = run(ip, &["netns", "del", name]);
        }
    }
}

/// The namespaces of one scenario; dropping it deletes them (and with them every veth and
/// bridge the test made: nothing is made in the root namespace).
struct Net {
    ip: PathBuf,
    tc: PathBuf,
    switch: String,
    ranks: Vec<String>,
    made: Vec<String>,
}

impl Net {
    fn rank_addr(r: u32) -> String {
        format!("10.213.0.{}", r + 1)
    }

    fn new(tools: &Tools, tag: &str) -> Net {
        let p = format!("{}-{tag}", prefix());
        let mut net = Net {
            ip: tools.ip.clone(),
            tc: tools.tc.clone(),
            switch: format!("{p}-sw"),
            ranks: (0..WORLD).map(|r| format!("{p}-r{r}")).collect(),
            made: Vec::new(),
        };
        let ip = net.ip.clone();
        let sw = net.switch.clone();
        let ns_add = |net: &mut Net, name: &str| {
            must(&ip, &["netns", "add", name]);
            net.made.push(name.to_owned());
            must(&ip, &["-n", name, "link", "set", "lo", "up"]);
        };
        ns_add(&mut net, &sw);
        let s = |args: &[&str]| must(&ip, &[&["-n", sw.as_str()], args].concat());
        for br in ["sa", "sb"] {
            s(&["link", "add", "name", br, "type", "bridge"]);
            s(&["link", "set", br, "up"]);
        }
        s(&["link", "add", "name", "ta", "type", "veth", "peer", "name", "tb"]);
        s(&["link", "set", "ta", "master", "sa", "up"]);
        s(&["link", "set", "tb", "master", "sb", "up"]);
        for r in 0..WORLD {
            let ns = net.ranks[r as usize].clone();
            ns_add(&mut net, &ns);
            let (h, l, u, d) = (format!("h{r}"), format!("l{r}"), format!("u{r}"), format!("d{r}"));
            let side = if r < 2 { "sa" } else { "sb" };
            s(&["link", "add", "name", &l, "type", "bridge"]);
            s(&["link", "set", &l, "up"]);
            s(&["link", "add", "name", &h, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
            s(&["link", "set", &h, "master", &l, "up"]);
            s(&["link", "add", "name", &u, "type", "veth", "peer", "name", &d]);
            s(&["link", "set", &u, "master", &l, "up"]);
            s(&["link", "set", &d, "master", side, "up"]);
            must(&ip, &["-n", &ns, "addr", "add", &format!("{}/24", Net::rank_addr(r)), "dev", "eth0"]);
            must(&ip, &["-n", &ns, "link", "set", "eth0", "up"]);
        }
        net
    }

    /// Drop every packet both ways on the switch's veth pair `a`–`b`; returns the qdisc used.
    fn cut(&self, a: &str, b: &str) -> &'static str {
        let add = |dev: &str, qdisc: &[&str]| {
            run(&self.tc, &[&["-n", self.switch.as_str(), "qdisc", "add", "dev", dev, "root"], qdisc].concat())
        };
        let netem = ["netem", "loss", "100%"];
        let fifo0 = ["pfifo", "limit", "0"];
        match add(a, &netem) {
            Ok(()) => {
                must(&self.tc, &["-n", &self.switch, "qdisc", "add", "dev", b, "root", "netem", "loss", "100%"]);
                "netem loss 100%"
            }
            Err(e) => {
                eprintln!("netem is not available ({e}); dropping with `pfifo limit 0` instead");
                for dev in [a, b] {
                    if let Err(e) = add(dev, &fifo0) {
                        panic!("cannot cut {a}-{b}: {e}");
                    }
                }
                "pfifo limit 0"
            }
        }
    }

    /// `tc -s qdisc show` of the cut devices, to show that packets were dropped.
    fn drop_stats(&self, devs: &[&str]) -> String {
        devs.iter()
            .map(|dev| {
                let out = Command::new(&self.tc)
                    .args(["-n", &self.switch, "-s", "qdisc", "show", "dev", dev])
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                let sent = out.lines().find(|l| l.contains("Sent")).unwrap_or("?").trim().to_owned();
                format!("{dev}: {sent}")
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            if let Err(e) = run(&self.ip, &["netns", "del", ns]) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}

// ---- the ranks ----

struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(u32, Instant, String)>,
    seen: Vec<(u32, Instant, String)>,
}

impl Job {
    fn start(net: &Net, go: &Path) -> Job {
        let (tx, lines) = mpsc::channel();
        let children = (0..WORLD)
            .map(|r| {
                let mut cmd = Command::new(&net.ip);
                cmd.args(["netns", "exec", &net.ranks[r as usize], env!("CARGO_BIN_EXE_cohort-rank")])
                    .env("MASTER_ADDR", Net::rank_addr(0))
                    .env("MASTER_PORT", PORT)
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", WORLD.to_string())
                    .env("LOCAL_WORLD_SIZE", WORLD.to_string())
                    .env("COHORT_TEST_SCENARIO", "netns-loop")
                    .env("COHORT_TEST_GO", go)
                    .env("COHORT_TEST_LINGER_MS", "2000")
                    .env("COHORT_SOCKET_IFNAME", "eth0")
                    // Each namespace stands for a host of its own: ranks of one machine would
                    // share memory, and no network cut would come between them.
                    .env("COHORT_SHM", "0")
                    .env("COHORT_INIT_TIMEOUT_MS", "20000")
                    .env("COHORT_HEARTBEAT_MS", "100")
                    .env("COHORT_PEER_DEAD_AFTER_MS", "1000")
                    .env("COHORT_TIMEOUT_MS", "60000")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                let mut child = cmd.spawn().expect("start cohort-rank under ip netns exec");
                for out in [
                    Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
                    Box::new(child.stderr.take().unwrap()),
                ] {
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        for line in BufReader::new(out).lines().map_while(Result::ok) {
                            let _ = tx.send((r, Instant::now(), line));
                        }
                    });
                }
                child
            })
            .collect();
        Job { children, lines, seen: Vec::new() }
    }

    /// Wait until every rank has printed `ready`; a rank that exits first fails the test.
    fn wait_ready(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut ready = 0;
        while ready < WORLD {
            if Instant::now() > deadline {
                panic!("the ranks did not get ready within {limit:?}: {:?}", self.seen);
            }
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(l) => {
                    ready += u32::from(l.2 == "ready");
                    self.seen.push(l);
                }
                Err(_) => {
                    for (r, c) in self.children.iter_mut().enumerate() {
                        if let Some(status) = c.try_wait().unwrap() {
                            std::thread::sleep(Duration::from_millis(50));
                            self.seen.extend(self.lines.try_iter());
                            panic!("rank {r} exited ({status}) before it was ready: {:?}", self.seen);
                        }
                    }
                }
            }
        }
    }

    /// Wait for every rank to exit; returns every line seen.
    fn finish(mut self, limit: Duration) -> Vec<(u32, Instant, String)> {
        let deadline = Instant::now() + limit;
        for r in 0..self.children.len() {
            loop {
                if self.children[r].try_wait().unwrap().is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    self.seen.extend(self.lines.try_iter());
                    panic!("rank {r} did not exit within {limit:?}: {:?}", self.seen);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        self.seen.extend(self.lines.try_iter());
        std::mem::take(&mut self.seen)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What one rank reported.
#[derive(Debug)]
struct Report {
    rank: u32,
    blame: Blame,
    text: String,
    after_cut: Duration,
    line: String,
}

/// Set up a scenario, run the ranks, cut the links (switch-side veth pairs) and collect each
/// rank's `netns-error` report (ranks that print none are missing from the result).
fn scenario(tag: &str, cut: &[(&str, &str)]) -> Option<Vec<Report>> {
    let tools = match can_run(tag) {
        Ok(t) => t,
        Err(reason) => {
            skip(&reason);
            return None;
        }
    };
    remove_stale(&tools.ip);
    let started = Instant::now();
    // Dropped last: the ranks are killed (the job) before their namespaces go.
    let net = Net::new(&tools, tag);
    let go = std::env::temp_dir().join(format!("{}-{tag}.go", prefix()));
    let _ = std::fs::remove_file(&go);
    let mut job = Job::start(&net, &go);
    job.wait_ready(Duration::from_secs(30));
    // Collectives run for a while before the cut.
    std::thread::sleep(Duration::from_millis(300));
    let cut_at = Instant::now();
    let mut kind = "";
    for (a, b) in cut {
        kind = net.cut(a, b);
    }
    std::fs::write(&go, b"go").expect("write the go file");
    let lines = job.finish(Duration::from_secs(30));
    let _ = std::fs::remove_file(&go);
    let devs: Vec<&str> = cut.iter().flat_map(|(a, b)| [*a, *b]).collect();
    eprintln!("[{tag}] cut {cut:?} with `{kind}`; drops: {}", net.drop_stats(&devs));
    for (r, at, line) in &lines {
        let t = at
            .checked_duration_since(cut_at)
            .map_or_else(|| "before the cut".to_owned(), |d| format!("+{} ms", d.as_millis()));
        eprintln!("[{tag}] rank {r} ({t}): {line}");
    }
    let reports: Vec<Report> = lines
        .iter()
        .filter_map(|(r, at, line)| {
            let rest = line.strip_prefix("netns-error ")?;
            let (fields, text) = rest.split_once(" :: ")?;
            let blame = fields.split_whitespace().find_map(|f| f.strip_prefix("blame="))?;
            let blame = Blame::parse(blame, WORLD).unwrap_or_else(|e| panic!("rank {r}: {e}: {line}"));
            Some(Report {
                rank: *r,
                blame,
                text: text.to_owned(),
                after_cut: at.saturating_duration_since(cut_at),
                line: line.clone(),
            })
        })
        .collect();
    drop(net);
    eprintln!("[{tag}] done in {:.1} s (setup, run, cut, teardown)", started.elapsed().as_secs_f64());
    Some(reports)
}

fn report_of(reports: &[Report], rank: u32) -> &Report {
    reports
        .iter()
        .find(|r| r.rank == rank)
        .unwrap_or_else(|| panic!("rank {rank} printed no netns-error line: {reports:#?}"))
}

/// Silence detection (1 s), not the collective timeout (60 s), ended the work.
fn assert_silence_timing(r: &Report) {
    assert!(
        r.after_cut < Duration::from_secs(10),
        "rank {} failed {:?} after the cut: {}",
        r.rank,
        r.after_cut,
        r.line
    );
}

fn ranks(rs: &[u32]) -> Vec<Rank> {
    rs.iter().map(|&r| Rank(r)).collect()
}

#[test]
fn a_rank_cut_off_from_every_peer_is_named_by_all_the_others() {
    let Some(reports) = scenario("iso", &[("u3", "d3")]) else { return };
    for r in 0..3 {
        let rep = report_of(&reports, r);
        assert_eq!(rep.blame, Blame::rank(Rank(3)), "rank {r}: {}", rep.line);
        assert!(rep.text.ends_with("; blame: rank 3"), "rank {r}: {}", rep.line);
        assert_silence_timing(rep);
    }
    let isolated = report_of(&reports, 3);
    assert_eq!(isolated.blame, Blame::cut(ranks(&[3]), ranks(&[0, 1, 2])), "rank 3: {}", isolated.line);
    assert!(isolated.text.contains("this rank is cut off from every peer"), "rank 3: {}", isolated.line);
    assert!(
        isolated.text.ends_with("; blame: a network cut between ranks [3] and ranks [0-2]"),
        "rank 3: {}",
        isolated.line
    );
    assert_silence_timing(isolated);
}

#[test]
fn a_cut_between_two_halves_is_reported_as_that_cut_by_every_rank() {
    let Some(reports) = scenario("cut", &[("ta", "tb")]) else { return };
    let (a, b) = (ranks(&[0, 1]), ranks(&[2, 3]));
    for r in 0..WORLD {
        let rep = report_of(&reports, r);
        assert_eq!(rep.blame.culprit(), None, "rank {r} blames a single rank: {}", rep.line);
        assert!(
            rep.blame == Blame::cut(a.clone(), b.clone()) || rep.blame == Blame::cut(b.clone(), a.clone()),
            "rank {r} does not blame the cut between [0-1] and [2-3]: {}",
            rep.line
        );
        assert!(
            rep.text.ends_with("; blame: a network cut between ranks [0-1] and ranks [2-3]")
                || rep.text.ends_with("; blame: a network cut between ranks [2-3] and ranks [0-1]"),
            "rank {r}: {}",
            rep.line
        );
        assert_silence_timing(rep);
    }
}
