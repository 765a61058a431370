//! [`PyStore`]: cohort's [`Store`] over the Python store object torch hands a backend's
//! creator (a `PrefixStore` over a `TCPStore`, a `FileStore`, a `HashStore`…).
//!
//! Every call runs on tokio's blocking pool: the thread attaches to the interpreter, calls the
//! Python method (torch's store bindings release the GIL while they wait on the network), and
//! the async caller awaits the result. No runtime thread ever waits for the GIL. Once the
//! group is shut down, or while the interpreter is finalizing, calls fail at once without
//! touching Python.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cohort_transports::store::{Store, StoreError, StoreFuture};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// cohort's [`Store`] over a Python `torch.distributed.Store`.
#[derive(Debug)]
pub(crate) struct PyStore {
    obj: Arc<Py<PyAny>>,
    timeout: Duration,
    closed: Arc<AtomicBool>,
}

impl PyStore {
    /// Wrap `obj`; its `timeout` property (a `timedelta`) becomes [`Store::timeout`].
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<PyStore> {
        let seconds: f64 = obj.getattr("timeout")?.call_method0("total_seconds")?.extract()?;
        let timeout = Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::from_secs(300));
        Ok(PyStore { obj: Arc::new(obj.clone().unbind()), timeout, closed: Arc::new(AtomicBool::new(false)) })
    }

    /// A flag that, once set, makes every later call fail without calling Python.
    pub(crate) fn closer(&self) -> Arc<AtomicBool> {
        self.closed.clone()
    }

    /// Run `f` with the store object on the blocking pool; a Python exception becomes a
    /// [`StoreError`] (a timeout when its message says so).
    fn call<'a, T, F>(&'a self, op: &'static str, keys: Vec<String>, f: F) -> StoreFuture<'a, T>
    where
        T: Send + 'static,
        F: for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T> + Send + 'static,
    {
        let obj = self.obj.clone();
        let closed = self.closed.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let io = |message: String| StoreError::Io { op, source: std::io::Error::other(message) };
            if closed.load(Ordering::Acquire) {
                return Err(io("the process group was shut down".into()));
            }
            let joined = tokio::task::spawn_blocking(move || {
                Python::try_attach(|py| f(obj.bind(py)).map_err(|e| e.to_string()))
                    .unwrap_or_else(|| Err("the Python interpreter is shutting down".into()))
            })
            .await;
            match joined {
                Ok(Ok(value)) => Ok(value),
                Ok(Err(message)) if message.to_ascii_lowercase().contains("timeout") => {
                    Err(StoreError::Timeout { op, keys, timeout })
                }
                Ok(Err(message)) => Err(io(message)),
                Err(e) => Err(io(format!("the store call did not finish: {e}"))),
            }
        })
    }
}

/// The bytes of a Python `bytes` object.
fn bytes_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    Ok(obj.cast::<PyBytes>()?.as_bytes().to_vec())
}

fn timedelta<'py>(py: Python<'py>, d: Duration) -> PyResult<Bound<'py, PyAny>> {
    py.import("datetime")?.getattr("timedelta")?.call1((0, d.as_secs(), d.subsec_micros()))
}

impl Store for PyStore {
    fn set<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        let (k, v) = (key.to_owned(), value.to_vec());
        self.call("set", vec![k.clone()], move |s| {
            s.call_method1("set", (k, PyBytes::new(s.py(), &v)))?;
            Ok(())
        })
    }

    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<u8>> {
        let k = key.to_owned();
        self.call("get", vec![k.clone()], move |s| bytes_of(&s.call_method1("get", (k,))?))
    }

    fn add<'a>(&'a self, key: &'a str, delta: i64) -> StoreFuture<'a, i64> {
        let k = key.to_owned();
        self.call("add", vec![k.clone()], move |s| s.call_method1("add", (k, delta))?.extract::<i64>())
    }

    fn compare_set<'a>(&'a self, key: &'a str, expected: &'a [u8], desired: &'a [u8]) -> StoreFuture<'a, Vec<u8>> {
        let (k, e, d) = (key.to_owned(), expected.to_vec(), desired.to_vec());
        self.call("compare_set", vec![k.clone()], move |s| {
            let py = s.py();
            bytes_of(&s.call_method1("compare_set", (k, PyBytes::new(py, &e), PyBytes::new(py, &d)))?)
        })
    }

    fn wait<'a>(&'a self, keys: &'a [&'a str], timeout: Duration) -> StoreFuture<'a, ()> {
        let ks: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let store_timeout = self.timeout;
        let fut = self.call("wait", ks.clone(), move |s| {
            s.call_method1("wait", (ks, timedelta(s.py(), timeout)?))?;
            Ok(())
        });
        // A timeout names the wait's own limit, not the store's.
        Box::pin(async move {
            fut.await.map_err(|e| match e {
                StoreError::Timeout { op, keys, timeout: t } if t == store_timeout => {
                    StoreError::Timeout { op, keys, timeout }
                }
                other => other,
            })
        })
    }

    fn check<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, bool> {
        let ks: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        self.call("check", ks.clone(), move |s| s.call_method1("check", (ks,))?.extract::<bool>())
    }

    fn delete_key<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool> {
        let k = key.to_owned();
        self.call("delete_key", vec![k.clone()], move |s| s.call_method1("delete_key", (k,))?.extract::<bool>())
    }

    fn num_keys(&self) -> StoreFuture<'_, u64> {
        self.call("num_keys", Vec::new(), |s| s.call_method0("num_keys")?.extract::<u64>())
    }

    fn append<'a>(&'a self, key: &'a str, value: &'a [u8]) -> StoreFuture<'a, ()> {
        let (k, v) = (key.to_owned(), value.to_vec());
        self.call("append", vec![k.clone()], move |s| {
            s.call_method1("append", (k, PyBytes::new(s.py(), &v)))?;
            Ok(())
        })
    }

    fn multi_get<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, Vec<Vec<u8>>> {
        let ks: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        self.call("multi_get", ks.clone(), move |s| {
            s.call_method1("multi_get", (ks,))?.try_iter()?.map(|v| bytes_of(&v?)).collect()
        })
    }

    fn multi_set<'a>(&'a self, items: &'a [(&'a str, &'a [u8])]) -> StoreFuture<'a, ()> {
        let ks: Vec<String> = items.iter().map(|(k, _)| (*k).to_owned()).collect();
        let vs: Vec<Vec<u8>> = items.iter().map(|(_, v)| v.to_vec()).collect();
        self.call("multi_set", ks.clone(), move |s| {
            let py = s.py();
            let values = PyList::new(py, vs.iter().map(|v| PyBytes::new(py, v)))?;
            s.call_method1("multi_set", (ks, values))?;
            Ok(())
        })
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
