//! [`PrefixStore`]: a namespace inside another store.

use std::sync::Arc;
use std::time::Duration;

use super::{Store, StoreError, StoreFuture};

/// Wraps a store and prefixes every key with `prefix/`, as PyTorch's `PrefixStore` does
/// (`joinKey`: `prefix + "/" + key`). Prefix stores nest: the outer prefix comes first.
///
/// `num_keys` is the inner store's count (all namespaces together), as in PyTorch. Errors name
/// the keys as the caller gave them, without the prefix.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// A view of `inner` whose keys all start with `prefix/`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore { prefix: prefix.into(), inner }
    }

    /// The prefix (without the `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn join(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn join_all(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.join(k)).collect()
    }

    /// Puts the caller's key names back into a timeout error.
    fn unprefix(&self, keys: &[&str], e: StoreError) -> StoreError {
        match e {
            StoreError::Timeout { op, timeout, .. } => {
                StoreError::Timeout { op, keys: keys.iter().map(|k| (*k).to_owned()).collect(), timeout }
            }
            other => other,
        }
    }
}

impl Store for PrefixStore {
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move { self.inner.set(&self.join(key), value).await })
    }

    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<u8>> {
        Box::pin(async move { self.inner.get(&self.join(key)).await.map_err(|e| self.unprefix(&[key], e)) })
    }

    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64> {
        Box::pin(async move { self.inner.add(&self.join(key), delta).await })
    }

    fn compare_set<'a>(&'a self, key: &'a str, expected: &'a [u8], desired: &'a [u8]) -> StoreFuture<'a, Vec<u8>> {
        Box::pin(async move { self.inner.compare_set(&self.join(key), expected, desired).await })
    }

    fn wait<'a>(&'a self, keys: &'a [&'a str], timeout: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let joined = self.join_all(keys);
            let refs: Vec<&str> = joined.iter().map(String::as_str).collect();
            self.inner.wait(&refs, timeout).await.map_err(|e| self.unprefix(keys, e))
        })
    }

    fn check<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let joined = self.join_all(keys);
            let refs: Vec<&str> = joined.iter().map(String::as_str).collect();
            self.inner.check(&refs).await
        })
    }

    fn delete_key<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(async move { self.inner.delete_key(&self.join(key)).await })
    }

    fn num_keys(&self) -> StoreFuture<'_, u64> {
        self.inner.num_keys()
    }

    fn append<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        Box::pin(async move { self.inner.append(&self.join(key), value).await })
    }

    fn multi_get<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, Vec<Vec<u8>>> {
        Box::pin(async move {
            let joined = self.join_all(keys);
            let refs: Vec<&str> = joined.iter().map(String::as_str).collect();
            self.inner.multi_get(&refs).await.map_err(|e| self.unprefix(keys, e))
        })
    }

    fn multi_set<'a>(&'a self, items: &'a [(&'a str, &'a [u8])]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let joined: Vec<(String, &[u8])> = items.iter().map(|(k, v)| (self.join(k), *v)).collect();
            let refs: Vec<(&str, &[u8])> = joined.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            self.inner.multi_set(&refs).await
        })
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::super::MemoryStore;
    use super::*;

    #[tokio::test]
    async fn prefix_store_joins_keys_with_a_slash_and_nests() {
        let memory = Arc::new(MemoryStore::new());
        let outer: Arc<dyn Store> = Arc::new(PrefixStore::new("pg0", memory.clone()));
        let inner = PrefixStore::new("sub", outer.clone());
        inner.set("k", b"v").await.unwrap();
        assert_eq!(memory.get("pg0/sub/k").await.unwrap(), b"v");
        assert_eq!(outer.get("sub/k").await.unwrap(), b"v");
        assert_eq!(inner.add("n", 2).await.unwrap(), 2);
        assert!(inner.check(&["k", "n"]).await.unwrap());
        assert_eq!(inner.compare_set("k", b"v", b"w").await.unwrap(), b"w");
        inner.append("k", b"x").await.unwrap();
        inner.multi_set(&[("a", b"1"), ("b", b"2")]).await.unwrap();
        assert_eq!(inner.multi_get(&["k", "b"]).await.unwrap(), [b"wx".to_vec(), b"2".to_vec()]);
        assert!(memory.check(&["pg0/sub/a", "pg0/sub/b", "pg0/sub/n"]).await.unwrap());
        assert_eq!(inner.num_keys().await.unwrap(), 4);
        assert!(inner.delete_key("a").await.unwrap());
        assert!(!memory.check(&["pg0/sub/a"]).await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn prefix_store_timeouts_name_the_callers_keys() {
        let memory = Arc::new(MemoryStore::with_timeout(Duration::from_secs(1)));
        let store = PrefixStore::new("p", memory);
        match store.wait(&["x"], Duration::from_secs(1)).await {
            Err(StoreError::Timeout { keys, .. }) => assert_eq!(keys, ["x"]),
            other => panic!("unexpected {other:?}"),
        }
        match store.get("y").await {
            Err(StoreError::Timeout { op: "get", keys, .. }) => assert_eq!(keys, ["y"]),
            other => panic!("unexpected {other:?}"),
        }
    }
}
