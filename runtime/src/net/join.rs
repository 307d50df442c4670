//! Joining the other nodes: the control plane on rank 0 (keys and barriers, `regflow-net`),
//! every node's data-plane address published there, then one connection per pair of nodes,
//! each through the handshake (protocol, build, plan fingerprint, the shared secret).

use super::{Cluster, ClusterOptions, PeerLink};
use crate::RuntimeError;
use regflow_net::control::{ControlClient, ControlServer};
use regflow_net::env::ClusterEnv;
use regflow_net::handshake::{check_bind, handshake, Expect, Identity, Secret};
use regflow_plan::Plan;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

impl Cluster {
    /// Joins the other nodes of a job as `env` says (rank, world, master; see
    /// [`ClusterEnv::from_env`] for torchrun, Slurm, Open MPI and PMI variables), for `plan`.
    ///
    /// Rank 0 hosts the control plane at the master's address. Every node listens for its
    /// peers (on loopback unless a secret is set: `REGFLOW_SECRET` or `REGFLOW_SECRET_FILE`),
    /// publishes that address, connects to every lower rank and accepts every higher one.
    /// Each connection proves the shared secret and agrees on protocol, build and plan
    /// fingerprint; any mismatch is refused on both sides, naming both ranks, hosts and
    /// values. Every wait ends within `options.timeout` with an error naming who is missing.
    ///
    /// One job per call: a program that runs several jobs one after another keeps a
    /// [`ClusterSession`] (the control plane stays up between them).
    pub fn join(env: &ClusterEnv, plan: &Plan, options: &ClusterOptions) -> Result<Cluster, RuntimeError> {
        ClusterSession::connect(env, options)?.join(plan)
    }

    /// Joins as [`Cluster::join`] does, and shares the plan: rank 0 must hold it and
    /// publishes it on the control plane; a rank given none (a `regflow daemon`) receives
    /// it from there. A rank given its own is still checked against rank 0's by
    /// fingerprint. Returns the cluster and the plan this node runs.
    pub fn join_sharing(
        env: &ClusterEnv,
        plan: Option<&Plan>,
        options: &ClusterOptions,
    ) -> Result<(Cluster, Plan), RuntimeError> {
        ClusterSession::connect(env, options)?.join_sharing(plan)
    }
}

/// This node's place among the others for as long as the program runs several jobs: its
/// connection to the control plane, and on rank 0 the control plane itself. Each
/// [`ClusterSession::join`] connects the nodes for one more job (its keys and barriers
/// named after the job's number, which every node counts alike), so rank 0's port is bound
/// once and no job waits on another's leftovers.
///
/// ```no_run
/// # use regflow_runtime::{ClusterEnv, ClusterOptions, ClusterSession, Job};
/// # fn plans() -> Vec<regflow_plan::Plan> { Vec::new() }
/// let env = ClusterEnv::from_env().unwrap().expect("started by a launcher");
/// let mut session = ClusterSession::connect(&env, &ClusterOptions::default()).unwrap();
/// for plan in plans() {
///     let cluster = session.join(&plan).unwrap();
///     Job::builder(plan).cluster(cluster).build().unwrap().wait().unwrap();
/// }
/// ```
pub struct ClusterSession {
    env: ClusterEnv,
    options: ClusterOptions,
    secret: Secret,
    control: std::sync::Arc<std::sync::Mutex<ControlClient>>,
    server: Option<std::sync::Arc<ControlServer>>,
    /// Jobs joined so far: the next one's number.
    jobs: u64,
}

impl std::fmt::Debug for ClusterSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSession")
            .field("rank", &self.env.rank)
            .field("world", &self.env.world)
            .field("jobs", &self.jobs)
            .finish_non_exhaustive()
    }
}

impl ClusterSession {
    /// Reaches the control plane (rank 0 starts it at the master's address first).
    pub fn connect(env: &ClusterEnv, options: &ClusterOptions) -> Result<ClusterSession, RuntimeError> {
        let (rank, world) = (env.rank, env.world);
        let (node, world16) = node_and_world(rank, world)?;
        let fail = |message: String| RuntimeError::Cluster { node, world: world16, message };
        let secret = match &options.secret {
            Some(secret) => secret.clone(),
            None => Secret::from_env().map_err(|e| fail(e.to_string()))?,
        };
        // The data plane's address is checked before anything else.
        check_bind(&data_bind(options, &secret), &secret).map_err(|e| fail(e.to_string()))?;
        let me = Identity::new(rank, world, String::new());
        let master = env.master();
        let server = if rank == 0 {
            let bind = resolve(&master).map_err(&fail)?;
            Some(std::sync::Arc::new(
                ControlServer::start(bind, me.clone(), secret.clone()).map_err(|e| fail(e.to_string()))?,
            ))
        } else {
            None
        };
        let control =
            ControlClient::connect(&master, &me, &secret, options.timeout).map_err(|e| fail(e.to_string()))?;
        Ok(ClusterSession {
            env: env.clone(),
            options: options.clone(),
            secret,
            control: std::sync::Arc::new(std::sync::Mutex::new(control)),
            server,
            jobs: 0,
        })
    }

    /// Connects the nodes for the next job, of `plan` (see [`Cluster::join`]).
    pub fn join(&mut self, plan: &Plan) -> Result<Cluster, RuntimeError> {
        self.join_inner(Some(plan)).map(|(cluster, _)| cluster)
    }

    /// Connects the nodes for the next job and shares its plan (see [`Cluster::join_sharing`]).
    pub fn join_sharing(&mut self, plan: Option<&Plan>) -> Result<(Cluster, Plan), RuntimeError> {
        let (cluster, received) = self.join_inner(plan)?;
        match (received, plan) {
            (Some(received), _) => Ok((cluster, received)),
            (None, Some(plan)) => Ok((cluster, plan.clone())),
            (None, None) => unreachable!("join_inner receives the plan when given none"),
        }
    }

    fn join_inner(&mut self, given: Option<&Plan>) -> Result<(Cluster, Option<Plan>), RuntimeError> {
        let (env, options, secret) = (&self.env, &self.options, &self.secret);
        let (rank, world) = (env.rank, env.world);
        let (node, world16) = node_and_world(rank, world)?;
        let fail = |message: String| RuntimeError::Cluster { node, world: world16, message };
        let job = self.jobs;
        self.jobs += 1;
        let key = |name: &str| format!("job{job}/{name}");
        let mut control = self.control.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if rank == 0 && given.is_none() {
            return Err(fail("rank 0 hosts the control plane and shares the plan, so it must be given one".into()));
        }
        let mut me = Identity::new(rank, world, given.map(Plan::fingerprint).unwrap_or_default());
        let deadline = Instant::now() + options.timeout;
        let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(50));

        let bind = data_bind(options, secret);
        let ip = bind.ip();
        // Rank 0 shares its plan; a rank without one takes it (and its fingerprint) from there.
        let mut received = None;
        match given {
            Some(plan) if rank == 0 => {
                control.set(&key("plan"), plan.to_json().as_bytes()).map_err(|e| fail(e.to_string()))?;
            }
            Some(_) => {}
            None => {
                let json = control.get(&key("plan"), left()).map_err(|e| fail(e.to_string()))?;
                let text =
                    String::from_utf8(json).map_err(|_| fail("rank 0 shared a plan that is not UTF-8".into()))?;
                let plan = Plan::from_json(&text).map_err(|e| fail(format!("rank 0 shared an invalid plan: {e}")))?;
                me.plan = plan.fingerprint();
                received = Some(plan);
            }
        }

        // This node's data-plane listener, published for the others below.
        let listener = TcpListener::bind(bind).map_err(|e| fail(format!("cannot listen on {bind}: {e}")))?;
        let port = listener.local_addr().map_err(|e| fail(e.to_string()))?.port();
        let advertised = match ip {
            ip if !ip.is_unspecified() => SocketAddr::new(ip, port).to_string(),
            _ => format!("{}:{port}", me.host),
        };
        control.set(&key(&format!("data/{rank}")), advertised.as_bytes()).map_err(|e| fail(e.to_string()))?;
        control.barrier(&key("addresses"), left()).map_err(|e| fail(e.to_string()))?;

        // Connect down, accept up: one connection per pair.
        let mut links = Vec::with_capacity(world as usize);
        for peer in 0..rank {
            let address = control.get(&key(&format!("data/{peer}")), left()).map_err(|e| fail(e.to_string()))?;
            let address = String::from_utf8_lossy(&address).into_owned();
            let mut stream = connect(&address, left()).map_err(|e| fail(format!("node {peer} at {address}: {e}")))?;
            prepare(&stream, left()).map_err(|e| fail(e.to_string()))?;
            let info = handshake(&mut stream, &me, secret, Expect::Rank(peer)).map_err(|e| fail(e.to_string()))?;
            links.push(PeerLink { rank: peer as u16, host: info.host, transport: Box::new(done(stream)?) });
        }
        listener.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
        let mut accepted = vec![false; world as usize];
        let mut refused: Vec<String> = Vec::new();
        while links.len() + 1 < world as usize {
            let (stream, from) = match listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<u32> = (rank + 1..world).filter(|&r| !accepted[r as usize]).collect();
                        let refusals = match refused.is_empty() {
                            true => String::new(),
                            false => format!(" (refused meanwhile: {})", refused.join("; ")),
                        };
                        return Err(fail(format!(
                            "nodes {missing:?} did not connect within {:?}{refusals}",
                            options.timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(fail(format!("accepting a peer failed: {e}"))),
            };
            stream.set_nonblocking(false).map_err(|e| fail(e.to_string()))?;
            // A stranger that connects and says nothing holds the join at most this long.
            prepare(&stream, left().min(HANDSHAKE_TIMEOUT)).map_err(|e| fail(e.to_string()))?;
            let mut stream = stream;
            // A stranger or a wrong peer is refused and dropped; the others go on.
            let info = match handshake(&mut stream, &me, secret, Expect::AnyOtherRank) {
                Ok(info) => info,
                // A stranger (garbage, a wrong secret, another plan) is refused and
                // dropped; the peers it is not keep connecting, and a timeout names what
                // was refused meanwhile.
                Err(e) => {
                    tracing::warn!("node {rank} refused a connection from {from}: {e}");
                    if refused.len() < 8 {
                        refused.push(format!("{from}: {e}"));
                    }
                    continue;
                }
            };
            if info.rank <= rank || accepted[info.rank as usize] {
                return Err(fail(format!(
                    "node {} ({}) connected to node {rank}, which connects to it instead or already has it",
                    info.rank, info.host
                )));
            }
            accepted[info.rank as usize] = true;
            links.push(PeerLink { rank: info.rank as u16, host: info.host, transport: Box::new(done(stream)?) });
        }
        control.barrier(&key("connected"), left()).map_err(|e| fail(e.to_string()))?;
        drop(control);
        let mut cluster = Cluster::from_links(node, world16, &me.host, links)?.with_silence_limit(options.silence);
        // The control plane lives as long as this job, even if the session is dropped first.
        cluster.keep = Some(Box::new((self.server.clone(), self.control.clone())));
        Ok((cluster, received))
    }
}

/// `rank` and `world` as node numbers, or the error naming both.
fn node_and_world(rank: u32, world: u32) -> Result<(u16, u16), RuntimeError> {
    match (u16::try_from(rank), u16::try_from(world)) {
        (Ok(r), Ok(w)) => Ok((r, w)),
        _ => Err(RuntimeError::Cluster {
            node: u16::MAX,
            world: u16::MAX,
            message: format!("rank {rank} of {world}: a job has at most {} nodes", u16::MAX),
        }),
    }
}

/// Where this node's data plane listens: `options.bind`, else every interface with a
/// secret and loopback without.
fn data_bind(options: &ClusterOptions, secret: &Secret) -> SocketAddr {
    let ip = options.bind.unwrap_or(if secret.is_set() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    });
    SocketAddr::new(ip, options.data_port.unwrap_or(0))
}

/// How long an accepted connection may take to complete its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

fn resolve(master: &str) -> Result<SocketAddr, String> {
    master
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve the master address {master}: {e}"))?
        .next()
        .ok_or_else(|| format!("the master address {master} resolves to nothing"))
}

fn connect(address: &str, timeout: Duration) -> Result<TcpStream, String> {
    let target = resolve(address)?;
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() >= deadline => return Err(format!("unreachable after {timeout:?}: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Timeouts for the handshake, so a silent peer cannot hold the join.
fn prepare(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))
}

/// After the handshake the data plane blocks without timeouts: its waits have owners
/// (the job's abort closes the connection).
fn done(stream: TcpStream) -> Result<TcpStream, RuntimeError> {
    let clear = |e: std::io::Error| RuntimeError::Cluster { node: 0, world: 0, message: e.to_string() };
    stream.set_read_timeout(None).map_err(clear)?;
    stream.set_write_timeout(None).map_err(clear)?;
    Ok(stream)
}
