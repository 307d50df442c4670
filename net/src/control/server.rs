//! The control server rank 0 runs: one tokio task per connection on a thread of its own.

use super::{decode_message, encode_message, message_len, ControlError, ControlReply, ControlRequest, WireError};
use crate::handshake::{check_bind, handshake_async, Expect, Identity, PeerInfo, Secret};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

/// How long a new connection has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How many dropped or refused connections [`ControlServer::refusals`] remembers.
const REFUSALS_KEPT: usize = 64;

/// Rank 0's control plane: accepts every rank's [`ControlClient`](super::ControlClient),
/// stores keys and runs barriers. Stops on [`ControlServer::shutdown`] or drop.
pub struct ControlServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ControlServer {
    /// Listens on `bind` (a loopback address, or any with a secret: see
    /// [`check_bind`]) as `me` (rank 0; its plan is not checked here) and serves on a
    /// thread named `regflow-control`.
    pub fn start(bind: SocketAddr, me: Identity, secret: Secret) -> Result<ControlServer, ControlError> {
        check_bind(&bind, &secret).map_err(|e| ControlError::Insecure(Box::new(e)))?;
        let bind_failed = |source| ControlError::Bind { addr: bind, source };
        let listener = std::net::TcpListener::bind(bind).map_err(bind_failed)?;
        let local_addr = listener.local_addr().map_err(bind_failed)?;
        listener.set_nonblocking(true).map_err(bind_failed)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|source| ControlError::Runtime { source })?;
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(listener).map_err(bind_failed)?
        };
        let shared = Arc::new(Shared {
            world: me.world,
            me: Identity { plan: String::new(), ..me },
            secret,
            state: Mutex::new(State::default()),
            changed: watch::Sender::new(0),
            refusals: Mutex::new(VecDeque::new()),
        });
        let (stop, stopped) = oneshot::channel();
        let serving = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("regflow-control".to_string())
            .spawn(move || {
                runtime.block_on(accept(listener, serving, stopped));
                // Dropping the runtime cancels every connection's task and closes its socket.
                drop(runtime);
            })
            .map_err(|source| ControlError::Runtime { source })?;
        Ok(ControlServer { local_addr, shared, stop: Some(stop), thread: Some(thread) })
    }

    /// The address it listens on (the port, when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The last connections it dropped or refused (at most 64), oldest first, each a sentence
    /// naming the peer's address and why.
    pub fn refusals(&self) -> Vec<String> {
        self.shared.refusals.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect()
    }

    /// Stops serving, closes every connection and joins the server's thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            // An error means the thread already ended; joining below says how.
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the control plane's thread panicked");
            }
        }
    }
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the state: values may be whole serialized plans.
        f.debug_struct("ControlServer").field("local_addr", &self.local_addr).finish_non_exhaustive()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// What every connection's task shares.
#[derive(Debug)]
struct Shared {
    me: Identity,
    secret: Secret,
    world: u32,
    state: Mutex<State>,
    /// Bumped on every change a waiter may care about (a barrier completes, a rank leaves,
    /// a key is set).
    changed: watch::Sender<u64>,
    refusals: Mutex<VecDeque<String>>,
}

#[derive(Debug, Default)]
struct State {
    members: BTreeMap<u32, Member>,
    /// Ranks that joined and left, with their host; a rank that joins again is removed.
    left: BTreeMap<u32, String>,
    values: HashMap<String, Vec<u8>>,
    barriers: HashMap<String, Barrier>,
}

#[derive(Debug)]
struct Member {
    host: String,
    addr: SocketAddr,
    connection: u64,
}

#[derive(Debug, Default)]
struct Barrier {
    /// Rounds completed; a rank arriving waits for the round it arrived in.
    round: u64,
    arrived: BTreeSet<u32>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.changed.send_modify(|generation| *generation += 1);
    }

    fn refuse(&self, sentence: String) {
        tracing::warn!("{sentence}");
        let mut refusals = self.refusals.lock().unwrap_or_else(PoisonError::into_inner);
        if refusals.len() == REFUSALS_KEPT {
            refusals.pop_front();
        }
        refusals.push_back(sentence);
    }

    fn join(&self, peer: &PeerInfo, addr: SocketAddr, connection: u64) -> Result<(), String> {
        let mut state = self.state();
        if let Some(first) = state.members.get(&peer.rank) {
            return Err(format!(
                "rank {} joined twice: from {} ({}) and {} ({addr})",
                peer.rank, first.host, first.addr, peer.host
            ));
        }
        state.members.insert(peer.rank, Member { host: peer.host.clone(), addr, connection });
        state.left.remove(&peer.rank);
        drop(state);
        self.bump();
        Ok(())
    }

    fn leave(&self, rank: u32, connection: u64) {
        let mut state = self.state();
        if state.members.get(&rank).is_some_and(|member| member.connection == connection) {
            if let Some(member) = state.members.remove(&rank) {
                state.left.insert(rank, member.host);
            }
            for barrier in state.barriers.values_mut() {
                barrier.arrived.remove(&rank);
            }
            drop(state);
            self.bump();
        }
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>, mut stop: oneshot::Receiver<()>) {
    let mut connections = 0u64;
    loop {
        tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, addr)) => {
                    connections += 1;
                    tokio::spawn(serve(Arc::clone(&shared), stream, addr, connections));
                }
                Err(e) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    tracing::warn!("the control plane could not accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

async fn serve(shared: Arc<Shared>, mut stream: TcpStream, addr: SocketAddr, connection: u64) {
    // Replies are small and each one is awaited: send them at once.
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let peer = match handshake_async(&mut stream, &shared.me, &shared.secret, Expect::AnyRank, deadline).await {
        Ok(peer) => peer,
        Err(e) => return shared.refuse(format!("the control plane dropped a connection from {addr}: {e}")),
    };
    if let Err(reason) = shared.join(&peer, addr, connection) {
        let _ = send(&mut stream, &ControlReply::Refused { reason: reason.clone() }).await;
        return shared.refuse(reason);
    }
    let served = match send(&mut stream, &ControlReply::Joined).await {
        Ok(()) => requests(&shared, &mut stream, &peer).await,
        Err(e) => Err(e),
    };
    shared.leave(peer.rank, connection);
    match served {
        Ok(()) => tracing::debug!("{peer} left the control plane"),
        Err(e) => tracing::warn!("the control plane dropped {peer} ({addr}): {e}"),
    }
}

/// Serves one rank's requests until it disconnects.
async fn requests(shared: &Shared, stream: &mut TcpStream, peer: &PeerInfo) -> Result<(), WireError> {
    while let Some(request) = receive(stream).await? {
        let reply = match request {
            ControlRequest::Set { key, value } => {
                shared.state().values.insert(key, value);
                shared.bump();
                ControlReply::Done
            }
            ControlRequest::Get { key, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms);
                let value = wait(shared, stream, deadline, |state| state.values.get(&key).cloned()).await?;
                value.map_or(ControlReply::GetTimedOut, ControlReply::Value)
            }
            ControlRequest::Barrier { name, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms);
                barrier(shared, stream, peer.rank, &name, deadline).await?
            }
        };
        send(stream, &reply).await?;
    }
    Ok(())
}

/// Arrives at barrier `name` as `rank` and waits for its round to complete.
async fn barrier(
    shared: &Shared,
    stream: &mut TcpStream,
    rank: u32,
    name: &str,
    deadline: Instant,
) -> Result<ControlReply, WireError> {
    let my_round = {
        let mut state = shared.state();
        let barrier = state.barriers.entry(name.to_string()).or_default();
        barrier.arrived.insert(rank);
        let round = barrier.round;
        if barrier.arrived.len() as u64 >= u64::from(shared.world) {
            barrier.round += 1;
            barrier.arrived.clear();
        }
        round
    };
    shared.bump();
    let world = shared.world;
    let outcome = wait(shared, stream, deadline, |state| {
        let barrier = state.barriers.get(name)?;
        if barrier.round > my_round {
            return Some(ControlReply::Done);
        }
        // A rank that left cannot arrive: fail now rather than at the timeout.
        let (rank, host) = (0..world).find_map(|r| match state.left.get(&r) {
            Some(host) if !barrier.arrived.contains(&r) && !state.members.contains_key(&r) => Some((r, host.clone())),
            _ => None,
        })?;
        Some(ControlReply::RankLeft { rank, host })
    })
    .await;
    let mut state = shared.state();
    let State { barriers, members, .. } = &mut *state;
    let barrier = barriers.entry(name.to_string()).or_default();
    if barrier.round > my_round {
        return outcome.map(|_| ControlReply::Done);
    }
    let arrived: Vec<u32> = barrier.arrived.iter().copied().collect();
    // This rank gives up: the others must not count it any more.
    barrier.arrived.remove(&rank);
    match outcome? {
        Some(reply) => Ok(reply),
        None => {
            let missing: Vec<u32> = (0..world).filter(|r| !arrived.contains(r)).collect();
            let never_joined = missing.iter().copied().filter(|r| !members.contains_key(r)).collect();
            Ok(ControlReply::BarrierTimedOut { missing, arrived, never_joined })
        }
    }
}

/// Waits until `ready` finds something in the state, or `deadline` passes (`Ok(None)`). The
/// rank must stay silent meanwhile: it disconnecting (or speaking) ends the wait with an error.
async fn wait<T>(
    shared: &Shared,
    stream: &mut TcpStream,
    deadline: Instant,
    mut ready: impl FnMut(&State) -> Option<T>,
) -> Result<Option<T>, WireError> {
    let mut changes = shared.changed.subscribe();
    loop {
        changes.borrow_and_update();
        if let Some(found) = ready(&shared.state()) {
            return Ok(Some(found));
        }
        let mut probe = [0u8; 1];
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(deadline) => return Ok(None),
            read = stream.read(&mut probe) => return Err(match read {
                Ok(0) => WireError::Io(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => WireError::Malformed("a request arrived while the last one was unanswered".to_string()),
                Err(e) => WireError::Io(e),
            }),
        }
    }
}

async fn receive(stream: &mut TcpStream) -> Result<Option<ControlRequest>, WireError> {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match stream.read(&mut prefix[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(WireError::Truncated),
            n => got += n,
        }
    }
    let len = message_len(prefix)?;
    let mut body = Vec::new();
    (&mut *stream).take(len as u64).read_to_end(&mut body).await?;
    if body.len() < len {
        return Err(WireError::Truncated);
    }
    decode_message(&body).map(Some)
}

async fn send(stream: &mut TcpStream, reply: &ControlReply) -> Result<(), WireError> {
    stream.write_all(&encode_message(reply)?).await?;
    Ok(())
}
