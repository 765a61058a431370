//! Every work is a `tracing` span: `work{op, seq, group, rank}`, closed with its state and
//! duration when it finishes.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cohort_core::{ReduceOp, Tensor};
use cohort_transports::{MemoryStore, ProcessGroup, Store, TcpOptions, TokioNet};
use tracing_subscriber::fmt::format::FmtSpan;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Two ranks under a subscriber of `level` that logs span closes: an allreduce, then one that
/// fails because rank 1 aborted. What was logged.
fn logged(level: tracing::Level) -> String {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_span_events(FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // The subscriber is this thread's, so every task runs on this thread.
    let _guard = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let opts = TcpOptions { timeout: Duration::from_secs(5), ..TcpOptions::default() };
        let (a, b) = tokio::join!(
            ProcessGroup::connect(TokioNet, store.clone(), 0, 2, opts.clone()),
            ProcessGroup::connect(TokioNet, store.clone(), 1, 2, opts.clone()),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        let wa = a.allreduce(vec![Tensor::from_slice(&[1.0f32])], ReduceOp::Sum).unwrap();
        let wb = b.allreduce(vec![Tensor::from_slice(&[2.0f32])], ReduceOp::Sum).unwrap();
        assert!(wa.span().metadata().is_some_and(|m| m.name() == "work") || level < tracing::Level::DEBUG);
        let (ra, rb) = tokio::join!(wa, wb);
        assert_eq!(ra.unwrap(), rb.unwrap());
        // A failed work's span closes too, and logs why: rank 1 leaves before the second.
        b.abort("rank 1 leaves");
        let w = a.allreduce(vec![Tensor::from_slice(&[1.0f32])], ReduceOp::Sum).unwrap();
        assert!(tokio::time::timeout(Duration::from_secs(5), w).await.expect("in time").is_err());
    });
    String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn every_work_is_a_span_that_closes_with_its_state() {
    let text = logged(tracing::Level::DEBUG);
    for rank in [0, 1] {
        let opened = format!("work{{op=all_reduce seq=1 group=0 rank={rank} state=\"completed\"");
        assert!(text.contains(&opened), "no closed span for rank {rank}'s allreduce in:\n{text}");
    }
    let failed = text.lines().find(|l| l.contains("op=all_reduce seq=2 group=0 rank=0") && l.contains("work failed"));
    assert!(failed.is_some_and(|l| l.contains("rank 1")), "no failed allreduce naming rank 1 in:\n{text}");
    assert!(text.contains("close time.busy="), "spans are closed:\n{text}");
}

#[test]
fn a_failed_work_is_logged_where_nobody_wants_its_span() {
    // At WARN the works' (debug) spans are not made; a failure is still logged, without them.
    let text = logged(tracing::Level::WARN);
    assert!(!text.contains("work{"), "no span at WARN:\n{text}");
    let failed = text.lines().find(|l| l.contains("work failed"));
    assert!(failed.is_some_and(|l| l.contains("rank 1")), "no failed allreduce naming rank 1 in:\n{text}");
}
