//! [`StoreState`]: the TCPStore server's logic, sans IO.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use super::wire::{CheckResponse, QueryType, Reply, Request, VALIDATION_MAGIC, WaitResponse};
use crate::protocol::{AuthNonce, AuthSecret, NONCE_LEN, Role, proof, verify};

/// One connected client of the server, named by the driver (any value unique among the
/// connections alive at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientId(pub u64);

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "client#{}", self.0)
    }
}

/// Whether a wait (or a barrier) is already satisfied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStatus {
    /// Registered: the client will show up in [`StoreState::poll_woken`] (or get a
    /// `STOP_WAITING` reply) once satisfied, unless it cancels or disconnects first.
    Waiting,
    /// Satisfied now; nothing was registered.
    Ready,
}

/// A command the state refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// ADD would leave the 64-bit range.
    #[error("adding {delta} to key {key:?} overflows a 64-bit integer")]
    AddOverflow {
        /// The key, lossily as UTF-8.
        key: String,
        /// The amount that was to be added.
        delta: i64,
    },
    /// ADD (or BARRIER) on a key whose value is not a decimal integer (`std::stoll` fails).
    #[error("key {key:?} holds {value:?}, which is not an integer")]
    NotAnInteger {
        /// The key, lossily as UTF-8.
        key: String,
        /// The value, lossily as UTF-8 (at most 64 bytes of it).
        value: String,
    },
}

/// Why the server must close a client's connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CloseReason {
    /// VALIDATE carried the wrong magic number.
    #[error("VALIDATE carried magic {0:#010x}, expected 0x3c85f7ce")]
    BadMagic(u32),
    /// A command failed in a way PyTorch's server answers by closing the connection.
    #[error("{query} failed: {error}")]
    CommandFailed {
        /// The failed command.
        query: QueryType,
        /// Why.
        error: StateError,
    },
    /// The connection's first request was not VALIDATE.
    #[error("first request was {0}, expected VALIDATE")]
    NotValidated(QueryType),
    /// The store has a secret and the client did not authenticate.
    #[error(
        "the store requires authentication (COHORT_AUTH_TOKEN is set on it) and the client sent {0} instead: a PyTorch TCPStore client, or a cohort client without the secret, cannot use this store"
    )]
    NotAuthenticated(QueryType),
    /// The client's proof is wrong: it has another secret.
    #[error("the client's proof of the shared secret is wrong: it has another secret (COHORT_AUTH_TOKEN)")]
    AuthFailed,
    /// The client authenticates, and the store has no secret.
    #[error("the client authenticates, and this store has no secret (COHORT_AUTH_TOKEN is not set on it)")]
    AuthUnexpected,
    /// The client authenticated a second time.
    #[error("the client authenticated a second time")]
    AuthRepeated,
    /// A challenge of the wrong length.
    #[error("COHORT_AUTH carried {0} bytes, expected a {NONCE_LEN}-byte nonce")]
    BadAuthNonce(usize),
}

/// What the server must do after [`StoreState::handle_request`]: send a reply or close a
/// connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerOutput {
    /// Send `reply` to `client`.
    Reply {
        /// The destination.
        client: ClientId,
        /// What to send.
        reply: Reply,
    },
    /// Close `client`'s connection (then call [`StoreState::handle_disconnect`]).
    Close {
        /// The client.
        client: ClientId,
        /// Why.
        reason: CloseReason,
    },
}

/// The TCPStore server's state: keys, queues and waiting clients.
///
/// Semantics follow PyTorch's libuv server (`LibUVStoreDaemon`, the default since 2.4):
/// ADD on a missing key starts from 0 and stores the decimal string; COMPARE_SET on a missing
/// key stores `desired` only when `expected` is empty, and otherwise answers `expected` without
/// storing anything; APPEND creates; GET of a missing key answers empty bytes; CHECK and WAIT
/// count a key as present when it is stored or names a non-empty queue; GETNUMKEYS counts stored
/// keys (not queues).
///
/// Two ways to drive it:
///
/// - **As a server** (the TCP driver): call [`handle_connect`](Self::handle_connect) for each new
///   connection, [`handle_request`](Self::handle_request) for each decoded request, and
///   [`handle_disconnect`](Self::handle_disconnect) when a connection ends; after each call drain
///   [`poll_output`](Self::poll_output) until `None` and send or close as told.
/// - **Directly** (an in-process store): call [`set`](Self::set), [`get`](Self::get) and the
///   other command methods; if you also register waiters with
///   [`handle_wait`](Self::handle_wait), drain [`poll_woken`](Self::poll_woken) after every
///   mutation. `handle_request` drains the woken clients into `STOP_WAITING` replies itself.
///
/// There is no clock: timeouts are the client's business (it sends CANCEL_WAIT), so no input
/// takes `now`.
#[derive(Debug, Clone, Default)]
pub struct StoreState {
    keys: BTreeMap<Vec<u8>, Vec<u8>>,
    queues: BTreeMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Key → the clients waiting for it, one entry per awaited occurrence, in arrival order.
    waiting: BTreeMap<Vec<u8>, Vec<ClientId>>,
    /// Client → how many of its awaited key occurrences are still missing.
    awaited: BTreeMap<ClientId, usize>,
    clients: BTreeMap<ClientId, Phase>,
    woken: VecDeque<ClientId>,
    outputs: VecDeque<ServerOutput>,
    /// The secret clients must prove they know, if the store has one.
    auth: Option<AuthSecret>,
    /// Each client's server nonce, given at connect (see [`StoreState::handle_connect_with`]).
    nonces: BTreeMap<ClientId, AuthNonce>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Connected; VALIDATE not yet received.
    Connected,
    /// Validated; with a secret, COHORT_AUTH not yet received.
    Validated,
    /// Challenged with this client nonce; COHORT_AUTH_PROOF not yet received.
    Challenged([u8; NONCE_LEN]),
    /// Serving requests.
    Serving,
    /// Told to close; requests are ignored until the disconnect.
    Closing,
}

impl StoreState {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store whose clients must prove they know `secret` right after VALIDATE
    /// (COHORT_AUTH, then COHORT_AUTH_PROOF; see [`crate::protocol::auth`]); any other request
    /// first closes the connection. Connect clients with
    /// [`handle_connect_with`](Self::handle_connect_with).
    pub fn with_auth(secret: AuthSecret) -> Self {
        StoreState { auth: Some(secret), ..Self::default() }
    }

    // -- Server inputs ---------------------------------------------------------------------

    /// A client connected. Its first request must be VALIDATE. Queues nothing.
    pub fn handle_connect(&mut self, client: ClientId) {
        self.clients.insert(client, Phase::Connected);
    }

    /// A client connected, with the fresh random nonce the store challenges it with if it has
    /// a secret (the driver draws it: this state draws no randomness). Queues nothing.
    pub fn handle_connect_with(&mut self, client: ClientId, nonce: AuthNonce) {
        self.handle_connect(client);
        self.nonces.insert(client, nonce);
    }

    /// One decoded request from `client` (a client never announced through
    /// [`handle_connect`](Self::handle_connect) is treated as newly connected).
    ///
    /// May queue, in [`poll_output`](Self::poll_output): the reply to this request, as PyTorch's
    /// server sends it (nothing for SET, APPEND, MULTI_SET, QUEUE_PUSH, VALIDATE, a WAIT that
    /// must wait, a BARRIER that is not complete); `STOP_WAITING` replies to other clients whose
    /// wait this request satisfied; or a [`ServerOutput::Close`] for this client (bad magic, a
    /// first request other than VALIDATE, ADD on a non-integer). Requests from a client told to
    /// close are ignored.
    pub fn handle_request(&mut self, client: ClientId, request: Request) {
        let phase = *self.clients.entry(client).or_insert(Phase::Connected);
        match (phase, request) {
            (Phase::Closing, _) => {}
            (_, Request::Validate { magic }) if magic != VALIDATION_MAGIC => {
                self.close(client, CloseReason::BadMagic(magic));
            }
            (Phase::Connected, Request::Validate { .. }) => {
                let next = if self.auth.is_some() { Phase::Validated } else { Phase::Serving };
                self.clients.insert(client, next);
            }
            (Phase::Connected, other) => self.close(client, CloseReason::NotValidated(other.query_type())),
            (Phase::Validated, Request::Auth { nonce }) => self.challenge(client, &nonce),
            (Phase::Challenged(theirs), Request::AuthProof { proof }) => self.check_proof(client, theirs, &proof),
            (Phase::Validated | Phase::Challenged(_), other) => {
                self.close(client, CloseReason::NotAuthenticated(other.query_type()));
            }
            (Phase::Serving, Request::Auth { .. } | Request::AuthProof { .. }) => {
                let reason = if self.auth.is_none() { CloseReason::AuthUnexpected } else { CloseReason::AuthRepeated };
                self.close(client, reason);
            }
            (Phase::Serving, request) => self.serve(client, request),
        }
        while let Some(woken) = self.woken.pop_front() {
            self.reply(woken, Reply::Wait(WaitResponse::StopWaiting));
        }
    }

    /// `client`'s connection ended: drops its waits. Queues nothing.
    pub fn handle_disconnect(&mut self, client: ClientId) {
        self.clients.remove(&client);
        self.nonces.remove(&client);
        self.handle_cancel_wait(client);
    }

    /// The next thing the server must do; call after every `handle_*` until it returns `None`.
    pub fn poll_output(&mut self) -> Option<ServerOutput> {
        self.outputs.pop_front()
    }

    // -- Waiting ---------------------------------------------------------------------------

    /// `client` waits until every key in `keys` exists (PyTorch's `waitKeys`).
    ///
    /// Returns [`WaitStatus::Ready`] when they all exist now; otherwise registers the wait and
    /// returns [`WaitStatus::Waiting`]. A client has at most one wait: a new one replaces the
    /// old. Queues nothing.
    pub fn handle_wait(&mut self, client: ClientId, keys: Vec<Vec<u8>>) -> WaitStatus {
        self.handle_cancel_wait(client);
        if self.check(&keys) {
            return WaitStatus::Ready;
        }
        let mut missing = 0;
        for key in keys {
            // As PyTorch counts: only keys not stored, even one naming a non-empty queue.
            if !self.keys.contains_key(&key) {
                self.waiting.entry(key).or_default().push(client);
                missing += 1;
            }
        }
        self.awaited.insert(client, missing);
        WaitStatus::Waiting
    }

    /// Drops `client`'s wait, if any (CANCEL_WAIT, or a disconnect). Returns whether it was
    /// waiting. Queues nothing.
    pub fn handle_cancel_wait(&mut self, client: ClientId) -> bool {
        if self.awaited.remove(&client).is_none() {
            return false;
        }
        self.waiting.retain(|_, clients| {
            clients.retain(|c| *c != client);
            !clients.is_empty()
        });
        true
    }

    /// Whether `client` has a registered wait.
    pub fn is_waiting(&self, client: ClientId) -> bool {
        self.awaited.contains_key(&client)
    }

    /// The next client whose wait became satisfied (its registration is gone). Call after every
    /// mutating command when driving the state directly, until it returns `None`.
    pub fn poll_woken(&mut self) -> Option<ClientId> {
        self.woken.pop_front()
    }

    // -- Commands --------------------------------------------------------------------------

    /// SET: stores `value` under `key` and wakes the clients waiting for it.
    pub fn set(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.wake_all(&key);
        self.keys.insert(key, value);
    }

    /// GET: the value under `key`, if any.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.keys.get(key).map(Vec::as_slice)
    }

    /// ADD: adds `delta` to the integer stored under `key` (0 when missing), stores the result
    /// as a decimal string, wakes the key's waiters and returns the result.
    ///
    /// The stored value is parsed as C++ `std::stoll` does: leading whitespace, an optional sign,
    /// at least one digit, and anything after the digits ignored.
    pub fn add(&mut self, key: Vec<u8>, delta: i64) -> Result<i64, StateError> {
        let sum = self.counter_after(&key, delta)?;
        self.set(key, sum.to_string().into_bytes());
        Ok(sum)
    }

    /// COMPARE_SET, as PyTorch answers it:
    ///
    /// - key missing, `expected` empty: stores `desired`, returns it;
    /// - key missing, `expected` not empty: stores nothing, returns `expected`;
    /// - key present: stores `desired` if the value equals `expected`; returns the value now
    ///   stored (the new one on success, the current one on failure).
    ///
    /// Wakes the key's waiters when the key was created. (PyTorch's libuv server also "wakes"
    /// them when nothing was stored, sending `STOP_WAITING` for a key that does not exist; this
    /// does not copy that.)
    pub fn compare_set(&mut self, key: Vec<u8>, expected: &[u8], desired: Vec<u8>) -> Vec<u8> {
        match self.keys.get_mut(&key) {
            Some(current) => {
                if current.as_slice() == expected {
                    *current = desired;
                }
                current.clone()
            }
            None if expected.is_empty() => {
                self.set(key, desired.clone());
                desired
            }
            None => expected.to_vec(),
        }
    }

    /// CHECK: whether every key is stored or names a non-empty queue.
    pub fn check<K: AsRef<[u8]>>(&self, keys: &[K]) -> bool {
        keys.iter().all(|key| {
            let key = key.as_ref();
            self.keys.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
        })
    }

    /// DELETE_KEY: removes `key`; returns whether it existed.
    pub fn delete_key(&mut self, key: &[u8]) -> bool {
        self.keys.remove(key).is_some()
    }

    /// GETNUMKEYS: how many keys are stored (queues not counted).
    pub fn num_keys(&self) -> usize {
        self.keys.len()
    }

    /// APPEND: appends `value` to the bytes under `key`, creating it when missing; wakes the
    /// key's waiters.
    pub fn append(&mut self, key: Vec<u8>, value: &[u8]) {
        self.wake_all(&key);
        self.keys.entry(key).or_default().extend_from_slice(value);
    }

    /// MULTI_GET: each key's value, empty for a missing key.
    pub fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<Vec<u8>> {
        keys.iter().map(|key| self.get(key.as_ref()).unwrap_or_default().to_vec()).collect()
    }

    /// MULTI_SET: SET of each pair, in order.
    pub fn multi_set(&mut self, items: Vec<(Vec<u8>, Vec<u8>)>) {
        for (key, value) in items {
            self.set(key, value);
        }
    }

    /// QUEUE_PUSH: appends `value` to the queue named `key` and wakes one waiting client: the
    /// first registered for `key` whose wait this completes (PyTorch's
    /// `wakeupOneWaitingClient`; clients ahead of it that wait for more keys count `key` as
    /// arrived).
    pub fn queue_push(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.wake_one(&key);
        self.queues.entry(key).or_default().push_back(value);
    }

    /// QUEUE_POP: the queue's length before the pop, and its first item if there was one.
    pub fn queue_pop(&mut self, key: &[u8]) -> (usize, Option<Vec<u8>>) {
        match self.queues.get_mut(key) {
            Some(queue) => {
                let len = queue.len();
                let item = queue.pop_front();
                if queue.is_empty() {
                    self.queues.remove(key);
                }
                (len, item)
            }
            None => (0, None),
        }
    }

    /// QUEUE_LEN: the queue's length (0 for an unknown queue).
    pub fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, VecDeque::len)
    }

    /// LIST_KEYS: every stored key, in byte order.
    pub fn list_keys(&self) -> Vec<Vec<u8>> {
        self.keys.keys().cloned().collect()
    }

    /// BARRIER: counts `client`'s arrival in the integer under `key` (as ADD 1, but waking
    /// nobody). When the count reaches `world_size`, wakes everyone waiting on `key` and returns
    /// [`WaitStatus::Ready`]; otherwise registers `client` as waiting for `key`.
    pub fn barrier(&mut self, client: ClientId, key: Vec<u8>, world_size: i64) -> Result<WaitStatus, StateError> {
        self.handle_cancel_wait(client);
        let count = self.counter_after(&key, 1)?;
        self.keys.insert(key.clone(), count.to_string().into_bytes());
        if count >= world_size {
            self.wake_all(&key);
            return Ok(WaitStatus::Ready);
        }
        self.waiting.entry(key).or_default().push(client);
        self.awaited.insert(client, 1);
        Ok(WaitStatus::Waiting)
    }

    // -- Helpers ---------------------------------------------------------------------------

    /// The integer under `key` (0 when missing) plus `delta`.
    fn counter_after(&self, key: &[u8], delta: i64) -> Result<i64, StateError> {
        let current = match self.keys.get(key) {
            Some(value) => parse_stoll(value).ok_or_else(|| StateError::NotAnInteger {
                key: lossy(key),
                value: lossy(&value[..value.len().min(64)]),
            })?,
            None => 0,
        };
        current.checked_add(delta).ok_or_else(|| StateError::AddOverflow { key: lossy(key), delta })
    }

    /// COHORT_AUTH: answer the client's challenge with this store's nonce and proof.
    fn challenge(&mut self, client: ClientId, theirs: &[u8]) {
        let (Some(secret), Ok(theirs)) = (&self.auth, <[u8; NONCE_LEN]>::try_from(theirs)) else {
            return self.close(client, CloseReason::BadAuthNonce(theirs.len()));
        };
        let mine = self.nonces.get(&client).map_or([0; NONCE_LEN], |n| n.0);
        let mut reply = mine.to_vec();
        reply.extend_from_slice(&proof(secret, Role::StoreServer, &theirs, &mine));
        self.clients.insert(client, Phase::Challenged(theirs));
        self.reply(client, Reply::Bytes(reply));
    }

    /// COHORT_AUTH_PROOF: serve the client if its proof is right, else close.
    fn check_proof(&mut self, client: ClientId, theirs: [u8; NONCE_LEN], sent: &[u8]) {
        let mine = self.nonces.get(&client).map_or([0; NONCE_LEN], |n| n.0);
        match &self.auth {
            Some(secret) if verify(secret, Role::StoreClient, &theirs, &mine, sent) => {
                self.clients.insert(client, Phase::Serving);
                self.reply(client, Reply::Int(1));
            }
            _ => self.close(client, CloseReason::AuthFailed),
        }
    }

    fn serve(&mut self, client: ClientId, request: Request) {
        let query = request.query_type();
        match request {
            Request::Validate { .. } | Request::Auth { .. } | Request::AuthProof { .. } => {}
            Request::Set { key, value } => self.set(key, value),
            Request::CompareSet { key, expected, desired } => {
                let now = self.compare_set(key, &expected, desired);
                self.reply(client, Reply::Bytes(now));
            }
            Request::Get { key } => {
                let value = self.get(&key).unwrap_or_default().to_vec();
                self.reply(client, Reply::Bytes(value));
            }
            Request::Add { key, delta } => match self.add(key, delta) {
                Ok(sum) => self.reply(client, Reply::Int(sum)),
                Err(error) => self.close(client, CloseReason::CommandFailed { query, error }),
            },
            Request::Check { keys } => {
                let check = if self.check(&keys) { CheckResponse::Ready } else { CheckResponse::NotReady };
                self.reply(client, Reply::Check(check));
            }
            Request::Wait { keys } => {
                if self.handle_wait(client, keys) == WaitStatus::Ready {
                    self.reply(client, Reply::Wait(WaitResponse::StopWaiting));
                }
            }
            Request::GetNumKeys => self.reply(client, Reply::Int(self.num_keys() as i64)),
            Request::DeleteKey { key } => {
                let existed = self.delete_key(&key);
                self.reply(client, Reply::Int(i64::from(existed)));
            }
            Request::Append { key, value } => self.append(key, &value),
            Request::MultiGet { keys } => {
                let values = self.multi_get(&keys);
                self.reply(client, Reply::MultiBytes(values));
            }
            Request::MultiSet { items } => self.multi_set(items),
            Request::CancelWait => {
                self.handle_cancel_wait(client);
                self.reply(client, Reply::Wait(WaitResponse::WaitCanceled));
            }
            Request::Ping { nonce } => self.reply(client, Reply::Nonce(nonce)),
            Request::QueuePush { key, value } => self.queue_push(key, value),
            Request::QueuePop { key } => {
                let (len, value) = self.queue_pop(&key);
                self.reply(client, Reply::QueuePop { len: len as i64, value });
            }
            Request::QueueLen { key } => {
                let len = self.queue_len(&key);
                self.reply(client, Reply::Int(len as i64));
            }
            Request::ListKeys => self.reply(client, Reply::Keys(self.list_keys())),
            Request::Barrier { key, world_size } => match self.barrier(client, key, world_size) {
                Ok(WaitStatus::Ready) => self.reply(client, Reply::Wait(WaitResponse::StopWaiting)),
                Ok(WaitStatus::Waiting) => {}
                Err(error) => self.close(client, CloseReason::CommandFailed { query, error }),
            },
        }
    }

    fn reply(&mut self, client: ClientId, reply: Reply) {
        self.outputs.push_back(ServerOutput::Reply { client, reply });
    }

    fn close(&mut self, client: ClientId, reason: CloseReason) {
        self.clients.insert(client, Phase::Closing);
        self.handle_cancel_wait(client);
        self.outputs.push_back(ServerOutput::Close { client, reason });
    }

    /// `key` was created or changed: every client waiting for it counts one occurrence arrived.
    fn wake_all(&mut self, key: &[u8]) {
        let Some(clients) = self.waiting.remove(key) else { return };
        for client in clients {
            self.arrived(client);
        }
    }

    /// An item was pushed on queue `key`: clients waiting for it count it arrived, in order,
    /// until one of them is satisfied.
    fn wake_one(&mut self, key: &[u8]) {
        let Some(clients) = self.waiting.get_mut(key) else { return };
        let mut taken = Vec::new();
        while !clients.is_empty() {
            let client = clients.remove(0);
            taken.push(client);
            if self.awaited.get(&client) == Some(&1) {
                break;
            }
        }
        if clients.is_empty() {
            self.waiting.remove(key);
        }
        for client in taken {
            self.arrived(client);
        }
    }

    fn arrived(&mut self, client: ClientId) {
        let Some(missing) = self.awaited.get_mut(&client) else { return };
        *missing = missing.saturating_sub(1);
        if *missing == 0 {
            self.awaited.remove(&client);
            self.woken.push_back(client);
        }
    }
}

/// C++ `std::stoll(s, nullptr, 10)`: `None` where it would throw.
fn parse_stoll(bytes: &[u8]) -> Option<i64> {
    let mut rest = bytes;
    while let [b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r', tail @ ..] = rest {
        rest = tail;
    }
    let negative = match rest {
        [b'-', tail @ ..] => {
            rest = tail;
            true
        }
        [b'+', tail @ ..] => {
            rest = tail;
            false
        }
        _ => false,
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let mut value: i64 = 0;
    for &d in &rest[..digits] {
        let d = i64::from(d - b'0');
        value = value.checked_mul(10)?;
        value = if negative { value.checked_sub(d)? } else { value.checked_add(d)? };
    }
    Some(value)
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ClientId = ClientId(1);
    const B: ClientId = ClientId(2);
    const C: ClientId = ClientId(3);

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn validated(clients: &[ClientId]) -> StoreState {
        let mut state = StoreState::new();
        for &client in clients {
            state.handle_connect(client);
            state.handle_request(client, Request::Validate { magic: VALIDATION_MAGIC });
        }
        assert_eq!(state.poll_output(), None);
        state
    }

    fn outputs(state: &mut StoreState) -> Vec<ServerOutput> {
        std::iter::from_fn(|| state.poll_output()).collect()
    }

    fn reply(client: ClientId, reply: Reply) -> ServerOutput {
        ServerOutput::Reply { client, reply }
    }

    fn stop(client: ClientId) -> ServerOutput {
        reply(client, Reply::Wait(WaitResponse::StopWaiting))
    }

    #[test]
    fn a_first_request_other_than_validate_closes_the_client() {
        let mut state = StoreState::new();
        state.handle_connect(A);
        state.handle_request(A, Request::Get { key: k("x") });
        let out = outputs(&mut state);
        assert_eq!(out, [ServerOutput::Close { client: A, reason: CloseReason::NotValidated(QueryType::Get) }]);
        assert_eq!(CloseReason::NotValidated(QueryType::Get).to_string(), "first request was GET, expected VALIDATE");
        // Further requests from a closing client are ignored.
        state.handle_request(A, Request::Set { key: k("x"), value: k("1") });
        assert_eq!(state.num_keys(), 0);
        assert_eq!(state.poll_output(), None);
    }

    fn secret(s: &str) -> AuthSecret {
        AuthSecret::new(s.as_bytes()).unwrap()
    }

    /// Connect `client` to a store with a secret, validate, send a challenge: the server's
    /// nonce and proof.
    fn challenged(state: &mut StoreState, client: ClientId, client_nonce: [u8; NONCE_LEN]) -> Vec<u8> {
        state.handle_connect_with(client, AuthNonce([9; NONCE_LEN]));
        state.handle_request(client, Request::Validate { magic: VALIDATION_MAGIC });
        state.handle_request(client, Request::Auth { nonce: client_nonce.to_vec() });
        match outputs(state).as_slice() {
            [ServerOutput::Reply { reply: Reply::Bytes(b), .. }] => b.clone(),
            other => panic!("expected the server's challenge, got {other:?}"),
        }
    }

    #[test]
    fn a_client_that_proves_the_secret_is_served_and_one_that_does_not_is_closed() {
        let mut state = StoreState::with_auth(secret("s3cret"));
        let challenge = challenged(&mut state, A, [1; NONCE_LEN]);
        let (server_nonce, server_proof) = challenge.split_at(NONCE_LEN);
        assert_eq!(server_nonce, [9; NONCE_LEN]);
        // The client checks the server's proof, then proves its own.
        assert!(verify(&secret("s3cret"), Role::StoreServer, &[1; NONCE_LEN], server_nonce, server_proof));
        let mine = proof(&secret("s3cret"), Role::StoreClient, &[1; NONCE_LEN], server_nonce);
        state.handle_request(A, Request::AuthProof { proof: mine.to_vec() });
        assert_eq!(outputs(&mut state), [reply(A, Reply::Int(1))]);
        state.handle_request(A, Request::Set { key: k("x"), value: k("1") });
        assert_eq!(state.get(b"x"), Some(b"1".as_slice()));

        // Another secret: its proof is refused, and nothing it sends is served.
        let _ = challenged(&mut state, B, [2; NONCE_LEN]);
        let wrong = proof(&secret("guess"), Role::StoreClient, &[2; NONCE_LEN], &[9; NONCE_LEN]);
        state.handle_request(B, Request::AuthProof { proof: wrong.to_vec() });
        assert_eq!(outputs(&mut state), [ServerOutput::Close { client: B, reason: CloseReason::AuthFailed }]);
        // The server's own proof reflected back is not a client's.
        let _ = challenged(&mut state, C, [3; NONCE_LEN]);
        let reflected = proof(&secret("s3cret"), Role::StoreServer, &[3; NONCE_LEN], &[9; NONCE_LEN]);
        state.handle_request(C, Request::AuthProof { proof: reflected.to_vec() });
        assert_eq!(outputs(&mut state), [ServerOutput::Close { client: C, reason: CloseReason::AuthFailed }]);
    }

    #[test]
    fn a_client_that_skips_authentication_is_closed_with_a_reason_a_torch_user_understands() {
        let mut state = StoreState::with_auth(secret("s3cret"));
        state.handle_connect_with(A, AuthNonce([9; NONCE_LEN]));
        state.handle_request(A, Request::Validate { magic: VALIDATION_MAGIC });
        state.handle_request(A, Request::Set { key: k("x"), value: k("1") });
        let reason = CloseReason::NotAuthenticated(QueryType::Set);
        assert_eq!(outputs(&mut state), [ServerOutput::Close { client: A, reason: reason.clone() }]);
        assert!(reason.to_string().contains("a PyTorch TCPStore client"), "{reason}");
        assert_eq!(state.num_keys(), 0);
        // A client that authenticates to a store without a secret is told so.
        let mut plain = validated(&[B]);
        plain.handle_request(B, Request::Auth { nonce: vec![1; NONCE_LEN] });
        assert_eq!(outputs(&mut plain), [ServerOutput::Close { client: B, reason: CloseReason::AuthUnexpected }]);
        // A challenge of the wrong length.
        let mut state = StoreState::with_auth(secret("s3cret"));
        state.handle_connect_with(C, AuthNonce([9; NONCE_LEN]));
        state.handle_request(C, Request::Validate { magic: VALIDATION_MAGIC });
        state.handle_request(C, Request::Auth { nonce: vec![1; 3] });
        assert_eq!(outputs(&mut state), [ServerOutput::Close { client: C, reason: CloseReason::BadAuthNonce(3) }]);
    }

    #[test]
    fn a_wrong_magic_closes_the_client_naming_the_magic() {
        let mut state = StoreState::new();
        state.handle_request(A, Request::Validate { magic: 0xDEAD_BEEF });
        let out = outputs(&mut state);
        assert_eq!(out, [ServerOutput::Close { client: A, reason: CloseReason::BadMagic(0xDEAD_BEEF) }]);
        assert!(CloseReason::BadMagic(0xDEAD_BEEF).to_string().contains("0xdeadbeef"));
        // Also after validation.
        let mut state = validated(&[B]);
        state.handle_request(B, Request::Validate { magic: 1 });
        assert!(matches!(state.poll_output(), Some(ServerOutput::Close { client: B, .. })));
    }

    #[test]
    fn a_second_valid_validate_is_accepted() {
        let mut state = validated(&[A]);
        state.handle_request(A, Request::Validate { magic: VALIDATION_MAGIC });
        state.handle_request(A, Request::Ping { nonce: 9 });
        assert_eq!(outputs(&mut state), [reply(A, Reply::Nonce(9))]);
    }

    #[test]
    fn set_then_get_returns_the_value_and_a_missing_key_gives_empty_bytes() {
        let mut state = validated(&[A]);
        state.handle_request(A, Request::Set { key: k("/a"), value: k("hello") });
        state.handle_request(A, Request::Get { key: k("/a") });
        state.handle_request(A, Request::Get { key: k("/missing") });
        assert_eq!(outputs(&mut state), [reply(A, Reply::Bytes(k("hello"))), reply(A, Reply::Bytes(Vec::new()))]);
    }

    #[test]
    fn add_starts_at_zero_and_stores_the_decimal_string() {
        let mut state = StoreState::new();
        assert_eq!(state.add(k("n"), 5), Ok(5));
        assert_eq!(state.get(b"n"), Some(&b"5"[..]));
        assert_eq!(state.add(k("n"), -7), Ok(-2));
        assert_eq!(state.get(b"n"), Some(&b"-2"[..]));
    }

    #[test]
    fn add_parses_like_stoll() {
        let mut state = StoreState::new();
        state.set(k("n"), k("  +12abc"));
        assert_eq!(state.add(k("n"), 1), Ok(13));
        for bad in ["", "abc", "-", " x1", "99999999999999999999"] {
            state.set(k("bad"), k(bad));
            assert!(matches!(state.add(k("bad"), 1), Err(StateError::NotAnInteger { .. })), "{bad:?}");
        }
        state.set(k("min"), k("-9223372036854775808"));
        assert_eq!(state.add(k("min"), 0), Ok(i64::MIN));
    }

    #[test]
    fn add_overflow_is_refused_and_leaves_the_value() {
        let mut state = StoreState::new();
        state.set(k("n"), i64::MAX.to_string().into_bytes());
        assert_eq!(state.add(k("n"), 1), Err(StateError::AddOverflow { key: "n".into(), delta: 1 }));
        assert_eq!(state.get(b"n"), Some(i64::MAX.to_string().as_bytes()));
    }

    #[test]
    fn add_on_a_non_integer_closes_the_client_and_keeps_the_key() {
        let mut state = validated(&[A]);
        state.handle_request(A, Request::Set { key: k("s"), value: k("text") });
        state.handle_request(A, Request::Add { key: k("s"), delta: 1 });
        let out = outputs(&mut state);
        assert!(matches!(
            &out[..],
            [ServerOutput::Close { client: A, reason: CloseReason::CommandFailed { query: QueryType::Add, .. } }]
        ));
        assert_eq!(state.get(b"s"), Some(&b"text"[..]));
    }

    #[test]
    fn compare_set_follows_pytorch_in_all_four_cases() {
        let mut state = StoreState::new();
        // Missing key, non-empty expected: nothing stored, expected returned.
        assert_eq!(state.compare_set(k("a"), b"old", k("new")), k("old"));
        assert_eq!(state.get(b"a"), None);
        // Missing key, empty expected: stored.
        assert_eq!(state.compare_set(k("a"), b"", k("first")), k("first"));
        assert_eq!(state.get(b"a"), Some(&b"first"[..]));
        // Present, mismatch: current returned, unchanged.
        assert_eq!(state.compare_set(k("a"), b"nope", k("second")), k("first"));
        assert_eq!(state.get(b"a"), Some(&b"first"[..]));
        // Present, match: swapped, new value returned.
        assert_eq!(state.compare_set(k("a"), b"first", k("second")), k("second"));
        assert_eq!(state.get(b"a"), Some(&b"second"[..]));
    }

    #[test]
    fn check_answers_ready_only_when_every_key_exists() {
        let mut state = validated(&[A]);
        state.set(k("a"), k("1"));
        state.queue_push(k("q"), k("item"));
        state.handle_request(A, Request::Check { keys: vec![k("a"), k("q")] });
        state.handle_request(A, Request::Check { keys: vec![k("a"), k("b")] });
        state.handle_request(A, Request::Check { keys: Vec::new() });
        assert_eq!(
            outputs(&mut state),
            [
                reply(A, Reply::Check(CheckResponse::Ready)),
                reply(A, Reply::Check(CheckResponse::NotReady)),
                reply(A, Reply::Check(CheckResponse::Ready)),
            ]
        );
    }

    #[test]
    fn wait_on_existing_keys_answers_at_once() {
        let mut state = validated(&[A]);
        state.set(k("a"), k("1"));
        state.handle_request(A, Request::Wait { keys: vec![k("a")] });
        assert_eq!(outputs(&mut state), [stop(A)]);
        assert!(!state.is_waiting(A));
    }

    #[test]
    fn wait_answers_when_the_last_missing_key_is_set() {
        let mut state = validated(&[A, B]);
        state.handle_request(A, Request::Wait { keys: vec![k("x"), k("y"), k("x")] });
        assert_eq!(state.poll_output(), None);
        assert!(state.is_waiting(A));
        state.handle_request(B, Request::Set { key: k("x"), value: k("1") });
        assert_eq!(state.poll_output(), None);
        state.handle_request(B, Request::Set { key: k("y"), value: k("2") });
        assert_eq!(outputs(&mut state), [stop(A)]);
        assert!(!state.is_waiting(A));
        // No second wake on a later change.
        state.handle_request(B, Request::Set { key: k("y"), value: k("3") });
        assert_eq!(state.poll_output(), None);
    }

    #[test]
    fn every_creating_command_wakes_waiters() {
        type Mutation = fn(&mut StoreState, ClientId);
        let cases: [(&str, Mutation); 5] = [
            ("add", |s, c| s.handle_request(c, Request::Add { key: b"w".to_vec(), delta: 1 })),
            ("append", |s, c| s.handle_request(c, Request::Append { key: b"w".to_vec(), value: b"x".to_vec() })),
            ("compare_set", |s, c| {
                s.handle_request(
                    c,
                    Request::CompareSet { key: b"w".to_vec(), expected: Vec::new(), desired: b"v".to_vec() },
                )
            }),
            ("multi_set", |s, c| {
                s.handle_request(
                    c,
                    Request::MultiSet { items: vec![(b"o".to_vec(), Vec::new()), (b"w".to_vec(), Vec::new())] },
                )
            }),
            ("set", |s, c| s.handle_request(c, Request::Set { key: b"w".to_vec(), value: Vec::new() })),
        ];
        for (name, mutate) in cases {
            let mut state = validated(&[A, B]);
            state.handle_request(A, Request::Wait { keys: vec![k("w")] });
            mutate(&mut state, B);
            let out: Vec<_> = outputs(&mut state)
                .into_iter()
                .filter(|o| matches!(o, ServerOutput::Reply { client: A, .. }))
                .collect();
            assert_eq!(out, [stop(A)], "{name}");
        }
    }

    #[test]
    fn compare_set_that_stores_nothing_wakes_nobody() {
        let mut state = validated(&[A, B]);
        state.handle_request(A, Request::Wait { keys: vec![k("w")] });
        state.handle_request(B, Request::CompareSet { key: k("w"), expected: k("x"), desired: k("y") });
        assert_eq!(outputs(&mut state), [reply(B, Reply::Bytes(k("x")))]);
        assert!(state.is_waiting(A));
    }

    #[test]
    fn cancel_wait_acknowledges_and_drops_the_waiter() {
        let mut state = validated(&[A, B]);
        state.handle_request(A, Request::Wait { keys: vec![k("w")] });
        state.handle_request(A, Request::CancelWait);
        assert_eq!(outputs(&mut state), [reply(A, Reply::Wait(WaitResponse::WaitCanceled))]);
        state.handle_request(B, Request::Set { key: k("w"), value: k("1") });
        assert_eq!(state.poll_output(), None);
        // Cancelling with no wait still acknowledges.
        state.handle_request(A, Request::CancelWait);
        assert_eq!(outputs(&mut state), [reply(A, Reply::Wait(WaitResponse::WaitCanceled))]);
    }

    #[test]
    fn a_disconnected_waiter_is_never_woken() {
        let mut state = validated(&[A, B]);
        state.handle_request(A, Request::Wait { keys: vec![k("w")] });
        state.handle_disconnect(A);
        assert!(!state.is_waiting(A));
        state.handle_request(B, Request::Set { key: k("w"), value: k("1") });
        assert_eq!(state.poll_output(), None);
    }

    #[test]
    fn direct_waiters_come_out_of_poll_woken() {
        let mut state = StoreState::new();
        assert_eq!(state.handle_wait(A, vec![k("a")]), WaitStatus::Waiting);
        assert_eq!(state.handle_wait(B, vec![k("a"), k("b")]), WaitStatus::Waiting);
        state.set(k("a"), k("1"));
        assert_eq!(state.poll_woken(), Some(A));
        assert_eq!(state.poll_woken(), None);
        state.append(k("b"), b"x");
        assert_eq!(state.poll_woken(), Some(B));
        assert_eq!(state.handle_wait(C, vec![k("a"), k("b")]), WaitStatus::Ready);
        assert!(!state.handle_cancel_wait(C));
    }

    #[test]
    fn a_new_wait_replaces_the_old_one() {
        let mut state = StoreState::new();
        state.handle_wait(A, vec![k("a")]);
        state.handle_wait(A, vec![k("b")]);
        state.set(k("a"), Vec::new());
        assert_eq!(state.poll_woken(), None);
        state.set(k("b"), Vec::new());
        assert_eq!(state.poll_woken(), Some(A));
    }

    #[test]
    fn delete_num_keys_multi_get_and_list_keys() {
        let mut state = validated(&[A]);
        state.handle_request(A, Request::MultiSet { items: vec![(k("b"), k("2")), (k("a"), k("1"))] });
        state.handle_request(A, Request::GetNumKeys);
        state.handle_request(A, Request::MultiGet { keys: vec![k("a"), k("zz"), k("b")] });
        state.handle_request(A, Request::ListKeys);
        state.handle_request(A, Request::DeleteKey { key: k("a") });
        state.handle_request(A, Request::DeleteKey { key: k("a") });
        state.handle_request(A, Request::GetNumKeys);
        assert_eq!(
            outputs(&mut state),
            [
                reply(A, Reply::Int(2)),
                reply(A, Reply::MultiBytes(vec![k("1"), Vec::new(), k("2")])),
                reply(A, Reply::Keys(vec![k("a"), k("b")])),
                reply(A, Reply::Int(1)),
                reply(A, Reply::Int(0)),
                reply(A, Reply::Int(1)),
            ]
        );
    }

    #[test]
    fn append_creates_then_extends() {
        let mut state = StoreState::new();
        state.append(k("a"), b"ab");
        state.append(k("a"), b"cd");
        assert_eq!(state.get(b"a"), Some(&b"abcd"[..]));
    }

    #[test]
    fn queues_push_pop_and_len_in_fifo_order() {
        let mut state = validated(&[A]);
        state.handle_request(A, Request::QueuePush { key: k("q"), value: k("1") });
        state.handle_request(A, Request::QueuePush { key: k("q"), value: k("2") });
        state.handle_request(A, Request::QueueLen { key: k("q") });
        state.handle_request(A, Request::QueuePop { key: k("q") });
        state.handle_request(A, Request::QueuePop { key: k("q") });
        state.handle_request(A, Request::QueuePop { key: k("q") });
        assert_eq!(
            outputs(&mut state),
            [
                reply(A, Reply::Int(2)),
                reply(A, Reply::QueuePop { len: 2, value: Some(k("1")) }),
                reply(A, Reply::QueuePop { len: 1, value: Some(k("2")) }),
                reply(A, Reply::QueuePop { len: 0, value: None }),
            ]
        );
        assert_eq!(state.num_keys(), 0, "queues are not keys");
    }

    #[test]
    fn a_queue_push_wakes_one_waiter() {
        let mut state = validated(&[A, B, C]);
        state.handle_request(A, Request::Wait { keys: vec![k("q")] });
        state.handle_request(B, Request::Wait { keys: vec![k("q")] });
        state.handle_request(C, Request::QueuePush { key: k("q"), value: k("1") });
        assert_eq!(outputs(&mut state), [stop(A)]);
        assert!(state.is_waiting(B));
        state.handle_request(C, Request::QueuePush { key: k("q"), value: k("2") });
        assert_eq!(outputs(&mut state), [stop(B)]);
    }

    #[test]
    fn barrier_releases_everyone_when_the_last_arrives() {
        let mut state = validated(&[A, B, C]);
        state.handle_request(A, Request::Barrier { key: k("bar"), world_size: 3 });
        state.handle_request(B, Request::Barrier { key: k("bar"), world_size: 3 });
        assert_eq!(state.poll_output(), None);
        state.handle_request(C, Request::Barrier { key: k("bar"), world_size: 3 });
        let mut out = outputs(&mut state);
        out.sort_by_key(|o| match o {
            ServerOutput::Reply { client, .. } | ServerOutput::Close { client, .. } => *client,
        });
        assert_eq!(out, [stop(A), stop(B), stop(C)]);
        assert_eq!(state.get(b"bar"), Some(&b"3"[..]));
    }

    #[test]
    fn barrier_on_a_non_integer_key_closes_the_client() {
        let mut state = validated(&[A]);
        state.set(k("bar"), k("x"));
        state.handle_request(A, Request::Barrier { key: k("bar"), world_size: 2 });
        assert!(matches!(state.poll_output(), Some(ServerOutput::Close { client: A, .. })));
    }

    #[test]
    fn ping_echoes_the_nonce() {
        let mut state = validated(&[A]);
        state.handle_request(A, Request::Ping { nonce: 0xABCD });
        assert_eq!(outputs(&mut state), [reply(A, Reply::Nonce(0xABCD))]);
    }
}
