//! The control plane over loopback: ranks on threads, a server on port 0.

use super::*;
use crate::handshake::{Identity, Secret};
use std::io::Write;
use std::net::TcpStream;
use std::thread;

/// Long enough never to pass in a test that works; it only bounds one that does not.
const PATIENCE: Duration = Duration::from_secs(10);

fn id(rank: u32, world: u32, host: &str) -> Identity {
    Identity { rank, world, host: host.into(), build: Identity::build_id(), plan: String::new() }
}

fn start(world: u32, secret: &Secret) -> ControlServer {
    ControlServer::start("127.0.0.1:0".parse().unwrap(), id(0, world, "host-a"), secret.clone()).unwrap()
}

fn connect(server: &ControlServer, me: &Identity) -> Result<ControlClient, ControlError> {
    ControlClient::connect(&server.local_addr().to_string(), me, &Secret::none(), PATIENCE)
}

/// The server's refusals once it has recorded `count` of them (it records them on its own
/// thread, possibly after the client saw its side of the error).
fn refusals(server: &ControlServer, count: usize) -> Vec<String> {
    for _ in 0..1000 {
        let refusals = server.refusals();
        if refusals.len() >= count {
            return refusals;
        }
        thread::sleep(Duration::from_millis(5));
    }
    panic!("the server recorded {:?}, expected {count} refusal(s)", server.refusals());
}

#[test]
fn four_ranks_exchange_keys_and_pass_barriers() {
    let server = start(4, &Secret::none());
    let master = server.local_addr().to_string();
    let ranks: Vec<_> = (0..4u32)
        .map(|rank| {
            let master = master.clone();
            thread::spawn(move || -> Result<Vec<String>, ControlError> {
                let me = id(rank, 4, &format!("host-{rank}"));
                let mut client = ControlClient::connect(&master, &me, &Secret::none(), PATIENCE)?;
                client.set(&format!("addr/{rank}"), format!("10.0.0.{rank}:7000").as_bytes())?;
                client.barrier("addresses", PATIENCE)?;
                let mut seen = Vec::new();
                for peer in 0..4 {
                    let value = client.get(&format!("addr/{peer}"), PATIENCE)?;
                    seen.push(String::from_utf8(value).unwrap());
                }
                client.barrier("done", PATIENCE)?;
                client.barrier("done", PATIENCE)?;
                Ok(seen)
            })
        })
        .collect();
    let expected: Vec<String> = (0..4).map(|rank| format!("10.0.0.{rank}:7000")).collect();
    for rank in ranks {
        assert_eq!(rank.join().unwrap().unwrap(), expected);
    }
    assert_eq!(server.refusals(), Vec::<String>::new());
}

#[test]
fn get_waits_for_a_later_set_and_times_out_naming_the_key() {
    let server = start(2, &Secret::none());
    let mut setter = connect(&server, &id(1, 2, "host-b")).unwrap();
    let mut getter = connect(&server, &id(0, 2, "host-a")).unwrap();
    let waiting = thread::spawn(move || getter.get("plan", PATIENCE).map(|value| (value, getter)));
    setter.set("plan", b"serialized plan").unwrap();
    let (value, mut getter) = waiting.join().unwrap().unwrap();
    assert_eq!(value, b"serialized plan");
    let error = getter.get("missing", Duration::from_millis(100)).unwrap_err();
    assert_eq!(error.to_string(), "key 'missing' was not set within 100 ms");
    setter.set("plan", b"replaced").unwrap();
    assert_eq!(getter.get("plan", PATIENCE).unwrap(), b"replaced");
}

#[test]
fn a_barrier_timeout_names_the_missing_ranks_and_those_that_never_joined() {
    let server = start(4, &Secret::none());
    let _rank_0 = connect(&server, &id(0, 4, "host-a")).unwrap();
    let mut rank_1 = connect(&server, &id(1, 4, "host-b")).unwrap();
    let _rank_2 = connect(&server, &id(2, 4, "host-c")).unwrap();
    let error = rank_1.barrier("start", Duration::from_millis(200)).unwrap_err();
    assert!(matches!(&error, ControlError::BarrierTimedOut { missing, arrived, never_joined, world: 4, .. }
        if *missing == [0, 2, 3] && *arrived == [1] && *never_joined == [3]));
    assert_eq!(
        error.to_string(),
        "barrier 'start' timed out after 200 ms: ranks [0, 2, 3] of 4 did not arrive \
         (rank 1 arrived; rank 3 never joined the control plane)"
    );
}

#[test]
fn a_rank_leaving_fails_the_barrier_others_wait_at_naming_it() {
    let server = start(3, &Secret::none());
    let mut rank_0 = connect(&server, &id(0, 3, "host-a")).unwrap();
    let _rank_1 = connect(&server, &id(1, 3, "host-b")).unwrap();
    let rank_2 = connect(&server, &id(2, 3, "host-c")).unwrap();
    // Rank 2 arrives and goes without waiting for the answer: it counts no more.
    let request = ControlRequest::Barrier { name: "x".into(), timeout_ms: 10_000 };
    rank_2.send_and_leave(&request);
    let error = rank_0.barrier("x", PATIENCE).unwrap_err();
    assert!(matches!(&error, ControlError::RankLeft { rank: 2, host, barrier } if host == "host-c" && barrier == "x"));
    assert_eq!(error.to_string(), "rank 2 (host-c) left the control plane while ranks waited at barrier 'x'");
}

#[test]
fn a_rank_joining_twice_is_refused_naming_both_hosts() {
    let server = start(2, &Secret::none());
    let _first = connect(&server, &id(1, 2, "host-a")).unwrap();
    let error = connect(&server, &id(1, 2, "host-b")).unwrap_err();
    let ControlError::Refused { reason, .. } = &error else { panic!("expected a refusal, got {error}") };
    assert!(reason.starts_with("rank 1 joined twice: from host-a (127.0.0.1:"), "{reason}");
    assert!(reason.contains(") and host-b (127.0.0.1:"), "{reason}");
    assert_eq!(refusals(&server, 1), std::slice::from_ref(reason));
}

#[test]
fn a_world_size_mismatch_is_refused_on_both_sides() {
    let server = start(4, &Secret::none());
    let error = connect(&server, &id(1, 3, "host-b")).unwrap_err();
    let ControlError::Handshake { source, .. } = &error else { panic!("expected a handshake error, got {error}") };
    assert_eq!(
        source.to_string(),
        "rank 0 on host-a was started with a world of 4 ranks, this node (rank 1 on host-b) with a world of 3"
    );
    let server_side = &refusals(&server, 1)[0];
    assert!(
        server_side.ends_with(
            "rank 1 on host-b was started with a world of 3 ranks, this node (rank 0 on host-a) with a world of 4"
        ),
        "{server_side}"
    );
}

#[test]
fn a_wrong_secret_is_refused_on_both_sides() {
    let server = start(2, &Secret::new("cluster-secret"));
    let master = server.local_addr().to_string();
    let error = ControlClient::connect(&master, &id(1, 2, "host-b"), &Secret::new("guess"), PATIENCE).unwrap_err();
    assert!(
        error.to_string().ends_with("rank 0 on host-a did not prove the cluster's shared secret (REGFLOW_SECRET)"),
        "{error}"
    );
    assert!(refusals(&server, 1)[0]
        .ends_with("rank 1 on host-b did not prove the cluster's shared secret (REGFLOW_SECRET)"));
    let mut client =
        ControlClient::connect(&master, &id(1, 2, "host-b"), &Secret::new("cluster-secret"), PATIENCE).unwrap();
    client.set("k", b"v").unwrap();
}

#[test]
fn an_unreachable_master_is_named_after_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let master = format!("127.0.0.1:{port}");
    let error =
        ControlClient::connect(&master, &id(1, 2, "host-b"), &Secret::none(), Duration::from_millis(300)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("the master {master} (rank 0) is unreachable after 300 ms: connection refused")
    );
    let error = ControlClient::connect("no-port", &id(1, 2, "b"), &Secret::none(), PATIENCE).unwrap_err();
    assert!(matches!(error, ControlError::BadMaster { .. }), "{error}");
}

#[test]
fn garbage_from_a_raw_connection_is_dropped_and_others_are_still_served() {
    let server = start(2, &Secret::none());
    let mut garbage = TcpStream::connect(server.local_addr()).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\nHost: regflow\r\n\r\n").unwrap();
    let _silent = TcpStream::connect(server.local_addr()).unwrap();
    let dropped = &refusals(&server, 1)[0];
    assert!(dropped.contains("does not speak regflow's wire protocol"), "{dropped}");
    let mut client = connect(&server, &id(1, 2, "host-b")).unwrap();
    client.set("still", b"served").unwrap();
    assert_eq!(client.get("still", PATIENCE).unwrap(), b"served");
}

#[test]
fn the_server_refuses_to_listen_beyond_loopback_without_a_secret() {
    let error = ControlServer::start("0.0.0.0:0".parse().unwrap(), id(0, 2, "a"), Secret::none()).unwrap_err();
    assert!(matches!(error, ControlError::Insecure(_)), "{error}");
}

#[test]
fn shutdown_closes_connections_and_later_calls_fail() {
    let server = start(2, &Secret::none());
    let mut client = connect(&server, &id(1, 2, "host-b")).unwrap();
    client.set("k", b"v").unwrap();
    server.shutdown();
    let error = client.get("k", PATIENCE).unwrap_err();
    assert!(matches!(error, ControlError::Lost { .. }), "{error}");
    assert!(matches!(client.set("k", b"v"), Err(ControlError::Broken { .. })));
}

#[test]
fn a_message_announcing_more_than_the_bound_is_refused_unread() {
    let too_long = ((MAX_CONTROL_FRAME_BYTES + 1) as u32).to_le_bytes();
    let error = read_message::<ControlReply>(&mut &too_long[..]).unwrap_err();
    assert!(matches!(error, WireError::TooLarge(len) if len == MAX_CONTROL_FRAME_BYTES as u64 + 1));
    let mut short = Vec::from(100u32.to_le_bytes());
    short.extend_from_slice(b"only a few bytes");
    assert!(matches!(read_message::<ControlReply>(&mut &short[..]), Err(WireError::Truncated)));
    let frame = encode_message(&ControlReply::Value(b"plan".to_vec())).unwrap();
    assert_eq!(read_message::<ControlReply>(&mut &frame[..]).unwrap(), Some(ControlReply::Value(b"plan".to_vec())));
}
