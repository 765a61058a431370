//! [`MemoryStore`]: the store in process memory.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cohort_core::store::StoreState;
use tokio::sync::Notify;

use super::{DEFAULT_TIMEOUT, Store, StoreError, StoreFuture, owned_keys};

/// An in-process store: a [`StoreState`] behind a mutex, and a [`Notify`] that wakes waiters
/// on every change. For tests and single-process groups; every clone of an
/// `Arc<MemoryStore>` sees the same keys.
#[derive(Debug)]
pub struct MemoryStore {
    state: Mutex<StoreState>,
    changed: Notify,
    timeout: Duration,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with PyTorch's default timeout (300 s).
    pub fn new() -> Self {
        Self::with_timeout(DEFAULT_TIMEOUT)
    }

    /// An empty store whose `get` / `multi_get` wait up to `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        MemoryStore { state: Mutex::new(StoreState::new()), changed: Notify::new(), timeout }
    }

    fn state(&self) -> MutexGuard<'_, StoreState> {
        // The state is only touched by the short, non-panicking calls below.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs a mutation and wakes every waiter.
    fn mutate<T>(&self, f: impl FnOnce(&mut StoreState) -> T) -> T {
        let out = f(&mut self.state());
        self.changed.notify_waiters();
        out
    }

    async fn wait_for(&self, op: &'static str, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let deadline = tokio::time::Instant::now().checked_add(timeout);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.state().check(keys) {
                return Ok(());
            }
            let woke = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, notified).await.is_ok(),
                None => {
                    notified.await;
                    true
                }
            };
            if !woke {
                return Err(StoreError::Timeout { op, keys: owned_keys(keys), timeout });
            }
        }
    }
}

impl Store for MemoryStore {
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.mutate(|s| s.set(key.as_bytes().to_vec(), value.to_vec()));
            Ok(())
        })
    }

    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<u8>> {
        Box::pin(async move {
            self.wait_for("get", &[key], self.timeout).await?;
            Ok(self.state().get(key.as_bytes()).unwrap_or_default().to_vec())
        })
    }

    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64> {
        Box::pin(async move { Ok(self.mutate(|s| s.add(key.as_bytes().to_vec(), delta))?) })
    }

    fn compare_set<'a>(&'a self, key: &'a str, expected: &'a [u8], desired: &'a [u8]) -> StoreFuture<'a, Vec<u8>> {
        Box::pin(async move { Ok(self.mutate(|s| s.compare_set(key.as_bytes().to_vec(), expected, desired.to_vec()))) })
    }

    fn wait<'a>(&'a self, keys: &'a [&'a str], timeout: Duration) -> StoreFuture<'a, ()> {
        Box::pin(self.wait_for("wait", keys, timeout))
    }

    fn check<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, bool> {
        Box::pin(async move { Ok(self.state().check(keys)) })
    }

    fn delete_key<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(async move { Ok(self.mutate(|s| s.delete_key(key.as_bytes()))) })
    }

    fn num_keys(&self) -> StoreFuture<'_, u64> {
        Box::pin(async move { Ok(self.state().num_keys() as u64) })
    }

    fn append<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.mutate(|s| s.append(key.as_bytes().to_vec(), value));
            Ok(())
        })
    }

    fn multi_get<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, Vec<Vec<u8>>> {
        Box::pin(async move {
            self.wait_for("multi_get", keys, self.timeout).await?;
            Ok(self.state().multi_get(keys))
        })
    }

    fn multi_set<'a>(&'a self, items: &'a [(&'a str, &'a [u8])]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let items = items.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.to_vec())).collect();
            self.mutate(|s| s.multi_set(items));
            Ok(())
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn memory_store_runs_every_command() {
        let store = MemoryStore::new();
        store.set("a", b"1").await.unwrap();
        assert_eq!(store.get("a").await.unwrap(), b"1");
        assert_eq!(store.add("n", 3).await.unwrap(), 3);
        assert_eq!(store.add("n", -1).await.unwrap(), 2);
        assert_eq!(store.get("n").await.unwrap(), b"2");
        assert_eq!(store.compare_set("c", b"", b"x").await.unwrap(), b"x");
        assert_eq!(store.compare_set("c", b"y", b"z").await.unwrap(), b"x");
        assert!(store.check(&["a", "n", "c"]).await.unwrap());
        assert!(!store.check(&["a", "missing"]).await.unwrap());
        store.append("c", b"yz").await.unwrap();
        assert_eq!(store.get("c").await.unwrap(), b"xyz");
        store.multi_set(&[("m1", b"1"), ("m2", b"2")]).await.unwrap();
        assert_eq!(store.multi_get(&["m2", "m1"]).await.unwrap(), [b"2".to_vec(), b"1".to_vec()]);
        assert_eq!(store.num_keys().await.unwrap(), 5);
        assert!(store.delete_key("a").await.unwrap());
        assert!(!store.delete_key("a").await.unwrap());
        assert_eq!(store.num_keys().await.unwrap(), 4);
    }

    #[tokio::test]
    async fn memory_store_add_on_text_is_refused() {
        let store = MemoryStore::new();
        store.set("t", b"text").await.unwrap();
        assert!(matches!(store.add("t", 1).await, Err(StoreError::Refused(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn memory_store_wait_wakes_on_set_and_times_out_naming_keys() {
        let store = Arc::new(MemoryStore::with_timeout(Duration::from_secs(5)));
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move { store.get("late").await })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        store.set("late", b"v").await.unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), b"v");

        let err = store.wait(&["never", "late"], Duration::from_secs(2)).await.unwrap_err();
        match &err {
            StoreError::Timeout { op: "wait", keys, timeout } => {
                assert_eq!(keys, &["never", "late"]);
                assert_eq!(*timeout, Duration::from_secs(2));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.to_string().contains("never"), "{err}");
    }
}
