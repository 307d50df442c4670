//! Handshakes over real loopback connections, both sides on their own threads.

use super::*;
use std::ffi::OsString;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

/// Guards every test against a hang; no test waits this long when it passes.
const SAFETY_TIMEOUT: Duration = Duration::from_secs(10);

fn id(rank: u32, world: u32, host: &str, plan: &str) -> Identity {
    Identity { rank, world, host: host.into(), build: Identity::build_id(), plan: plan.into() }
}

fn pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    for stream in [&client, &server] {
        stream.set_read_timeout(Some(SAFETY_TIMEOUT)).unwrap();
        stream.set_write_timeout(Some(SAFETY_TIMEOUT)).unwrap();
    }
    (client, server)
}

type Outcome = Result<PeerInfo, HandshakeError>;

/// Runs `a` and `b` against each other and returns both outcomes.
fn both(a: (Identity, Secret, Expect), b: (Identity, Secret, Expect)) -> (Outcome, Outcome) {
    let (mut a_stream, mut b_stream) = pair();
    let b_side = thread::spawn(move || handshake(&mut b_stream, &b.0, &b.1, b.2));
    let a_result = handshake(&mut a_stream, &a.0, &a.1, a.2);
    (a_result, b_side.join().unwrap())
}

fn secret(key: &str) -> Secret {
    Secret::new(key.as_bytes())
}

#[test]
fn handshake_returns_each_side_the_other_sides_rank_and_host() {
    for key in [Secret::none(), secret("s3cret")] {
        let (a, b) = both(
            (id(0, 2, "host-a", "plan-1"), key.clone(), Expect::Rank(1)),
            (id(1, 2, "host-b", "plan-1"), key, Expect::AnyOtherRank),
        );
        assert_eq!(a.unwrap(), PeerInfo { rank: 1, host: "host-b".into() });
        assert_eq!(b.unwrap(), PeerInfo { rank: 0, host: "host-a".into() });
    }
}

#[test]
fn a_node_reaches_its_own_rank_only_when_it_expects_it() {
    let (a, b) = both(
        (id(0, 2, "host-a", ""), Secret::none(), Expect::Rank(0)),
        (id(0, 2, "host-a", ""), Secret::none(), Expect::AnyRank),
    );
    assert_eq!(a.unwrap().rank, 0);
    assert_eq!(b.unwrap().rank, 0);
}

#[test]
fn wrong_secret_is_refused_on_both_sides() {
    let (a, b) = both(
        (id(0, 2, "host-a", "p"), secret("alpha-secret"), Expect::Rank(1)),
        (id(1, 2, "host-b", "p"), secret("bravo-secret"), Expect::AnyOtherRank),
    );
    for (error, peer) in [(a.unwrap_err(), "rank 1 on host-b"), (b.unwrap_err(), "rank 0 on host-a")] {
        assert!(matches!(error, HandshakeError::BadProof { hint: "", .. }), "{error}");
        let text = error.to_string();
        assert_eq!(text, format!("{peer} did not prove the cluster's shared secret (REGFLOW_SECRET)"));
        assert!(!text.contains("alpha") && !text.contains("bravo"));
    }
}

#[test]
fn a_side_without_the_secret_is_refused_and_both_sides_say_which_lacks_it() {
    let (a, b) = both(
        (id(0, 2, "host-a", "p"), secret("alpha-secret"), Expect::AnyOtherRank),
        (id(1, 2, "host-b", "p"), Secret::none(), Expect::Rank(0)),
    );
    let (a, b) = (a.unwrap_err().to_string(), b.unwrap_err().to_string());
    assert_eq!(a, "rank 1 on host-b did not prove the cluster's shared secret (REGFLOW_SECRET); it has no secret set");
    assert_eq!(
        b,
        "rank 0 on host-a did not prove the cluster's shared secret (REGFLOW_SECRET); this node has no secret set"
    );
}

#[test]
fn different_plans_are_refused_naming_both_fingerprints() {
    let (a, b) = both(
        (id(0, 2, "host-a", "91bc0d4e5f60718293a4b5c6"), Secret::none(), Expect::AnyOtherRank),
        (id(1, 2, "host-b", "3fa2aa4e5f60718293a4b5c6"), Secret::none(), Expect::AnyOtherRank),
    );
    assert_eq!(
        a.unwrap_err().to_string(),
        "rank 1 on host-b runs plan 3fa2aa4e5f60…, this node (rank 0 on host-a) runs plan 91bc0d4e5f60…"
    );
    match b.unwrap_err() {
        HandshakeError::Plan { peer, theirs, ours, .. } => {
            assert_eq!(peer.rank, 0);
            assert_eq!((theirs.as_str(), ours.as_str()), ("91bc0d4e5f60718293a4b5c6", "3fa2aa4e5f60718293a4b5c6"));
        }
        other => panic!("expected a plan mismatch, got {other}"),
    }
}

#[test]
fn different_world_sizes_are_refused_naming_both() {
    let (a, b) = both(
        (id(0, 4, "host-a", ""), Secret::none(), Expect::AnyOtherRank),
        (id(1, 3, "host-b", ""), Secret::none(), Expect::AnyOtherRank),
    );
    assert_eq!(
        a.unwrap_err().to_string(),
        "rank 1 on host-b was started with a world of 3 ranks, this node (rank 0 on host-a) with a world of 4"
    );
    assert!(matches!(b.unwrap_err(), HandshakeError::World { theirs: 4, ours: 3, .. }));
}

#[test]
fn a_peer_claiming_this_nodes_rank_is_refused_on_both_sides() {
    let (a, b) = both(
        (id(1, 4, "host-a", ""), Secret::none(), Expect::AnyOtherRank),
        (id(1, 4, "host-b", ""), Secret::none(), Expect::AnyOtherRank),
    );
    assert_eq!(
        a.unwrap_err().to_string(),
        "a peer on host-b claims rank 1, which is this node's own rank (rank 1 on host-a); \
         two nodes were started with the same rank"
    );
    assert!(matches!(b.unwrap_err(), HandshakeError::DuplicateRank { peer_host, .. } if peer_host == "host-a"));
}

#[test]
fn an_unexpected_rank_is_refused_and_the_peer_hears_why() {
    let (a, b) = both(
        (id(0, 4, "host-a", ""), Secret::none(), Expect::Rank(2)),
        (id(1, 4, "host-b", ""), Secret::none(), Expect::AnyOtherRank),
    );
    let a = a.unwrap_err();
    assert!(matches!(a, HandshakeError::UnexpectedRank { expected: 2, ref peer, .. } if peer.rank == 1), "{a}");
    assert_eq!(
        a.to_string(),
        "this node (rank 0 on host-a) expected rank 2 on this connection, but rank 1 on host-b answered"
    );
    match b.unwrap_err() {
        HandshakeError::Refused { peer: Some(peer), reason } => {
            assert_eq!(peer, PeerInfo { rank: 0, host: "host-a".into() });
            assert_eq!(reason, a.to_string());
        }
        other => panic!("expected a refusal, got {other}"),
    }
}

#[test]
fn a_rank_outside_the_world_is_refused() {
    let (a, b) = both(
        (id(0, 4, "host-a", ""), Secret::none(), Expect::AnyOtherRank),
        (id(7, 4, "host-b", ""), Secret::none(), Expect::AnyOtherRank),
    );
    assert_eq!(a.unwrap_err().to_string(), "rank 7 on host-b claims a rank outside the world of 4 ranks (0 to 3)");
    assert!(matches!(b.unwrap_err(), HandshakeError::Refused { reason, .. } if reason.contains("rank 7 on host-b")));
}

/// Plays a peer by hand: sends `hello`, then returns the first two frames it reads.
fn fake_peer(mut stream: TcpStream, hello: Hello) -> thread::JoinHandle<Vec<Header>> {
    thread::spawn(move || {
        stream.write_all(&frame::encode(&Header::Hello(hello)).unwrap()).unwrap();
        let mut reader = FrameReader::new(stream);
        (0..2).map_while(|_| reader.read_header().ok().flatten()).collect()
    })
}

fn hello_of(me: &Identity) -> Hello {
    Hello {
        protocol: PROTOCOL_VERSION,
        build: me.build.clone(),
        plan: me.plan.clone(),
        rank: me.rank,
        world: me.world,
        host: me.host.clone(),
        nonce: [7; 32],
    }
}

#[test]
fn another_protocol_version_is_refused_and_told_so() {
    let (mut stream, peer_stream) = pair();
    let hello = Hello { protocol: PROTOCOL_VERSION + 1, ..hello_of(&id(1, 2, "host-b", "")) };
    let peer = fake_peer(peer_stream, hello);
    let error = handshake(&mut stream, &id(0, 2, "host-a", ""), &Secret::none(), Expect::AnyOtherRank).unwrap_err();
    assert!(matches!(error, HandshakeError::Version { theirs: 2, ours: 1, .. }), "{error}");
    assert_eq!(
        error.to_string(),
        "rank 1 on host-b speaks wire protocol version 2, this node (rank 0 on host-a) speaks version 1; \
         all nodes of a job must run the same regflow"
    );
    drop(stream);
    let frames = peer.join().unwrap();
    assert!(matches!(&frames[0], Header::Hello(hello) if hello.rank == 0));
    assert_eq!(frames[1], Header::Refused { reason: error.to_string() });
}

#[test]
fn another_build_is_refused_naming_both_builds() {
    let (mut stream, peer_stream) = pair();
    let peer =
        fake_peer(peer_stream, Hello { build: "regflow 9.9.9 riscv64-linux".into(), ..hello_of(&id(1, 2, "b", "")) });
    let error = handshake(&mut stream, &id(0, 2, "a", ""), &Secret::none(), Expect::AnyOtherRank).unwrap_err();
    assert!(matches!(&error, HandshakeError::Build { theirs, ours, .. }
        if theirs == "regflow 9.9.9 riscv64-linux" && *ours == Identity::build_id()));
    drop(stream);
    peer.join().unwrap();
}

#[test]
fn a_peer_echoing_this_nodes_nonce_is_refused() {
    let (mut stream, mut peer_stream) = pair();
    let echo = thread::spawn(move || {
        let mut reader = FrameReader::new(peer_stream.try_clone().unwrap());
        let Some(Header::Hello(mut hello)) = reader.read_header().unwrap() else { panic!("no hello") };
        hello.rank = 1;
        peer_stream.write_all(&frame::encode(&Header::Hello(hello)).unwrap()).unwrap();
    });
    let error = handshake(&mut stream, &id(0, 2, "host-a", ""), &Secret::none(), Expect::AnyOtherRank).unwrap_err();
    assert!(matches!(error, HandshakeError::EchoedNonce { .. }), "{error}");
    echo.join().unwrap();
}

#[test]
fn garbage_instead_of_a_hello_is_an_error_not_a_panic() {
    let inputs: [&[u8]; 3] = [b"GET / HTTP/1.1\r\nHost: node\r\n\r\n", &[3, 0, 0, 0, 0xff, 0xff, 0xff], &[9, 0]];
    for garbage in inputs {
        let (mut stream, mut peer_stream) = pair();
        peer_stream.write_all(garbage).unwrap();
        // Half-closed, not dropped: this side's hello must not bounce off a closed socket.
        peer_stream.shutdown(std::net::Shutdown::Write).unwrap();
        let error = handshake(&mut stream, &id(0, 2, "host-a", ""), &Secret::none(), Expect::Rank(1)).unwrap_err();
        match error {
            HandshakeError::NotRegflow { peer, .. } | HandshakeError::Closed { peer, .. } => assert_eq!(peer, "rank 1"),
            other => panic!("garbage {garbage:?} gave {other}"),
        }
    }
}

#[test]
fn a_silent_peer_times_out_naming_the_rank_awaited() {
    let (mut stream, _silent) = pair();
    stream.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let error = handshake(&mut stream, &id(0, 4, "host-a", ""), &Secret::none(), Expect::Rank(3)).unwrap_err();
    assert!(matches!(&error, HandshakeError::Timeout { peer, awaited: "hello" } if peer == "rank 3"), "{error}");
    assert!(error.to_string().starts_with("rank 3 did not answer the handshake within the timeout"));
}

#[test]
fn a_peer_closing_the_connection_is_named() {
    let (mut stream, peer_stream) = pair();
    drop(peer_stream);
    let error = handshake(&mut stream, &id(0, 4, "host-a", ""), &Secret::none(), Expect::AnyOtherRank).unwrap_err();
    assert!(matches!(error, HandshakeError::Closed { awaited: "hello", .. }), "{error}");
}

#[test]
fn binding_beyond_loopback_needs_a_secret() {
    let any: SocketAddr = "0.0.0.0:29500".parse().unwrap();
    let error = check_bind(&any, &Secret::none()).unwrap_err();
    assert!(error.to_string().starts_with("refusing to listen on 0.0.0.0:29500 without a shared secret"));
    assert!(error.to_string().contains("REGFLOW_SECRET"));
    check_bind(&any, &secret("s")).unwrap();
    check_bind(&"127.0.0.1:29500".parse().unwrap(), &Secret::none()).unwrap();
    check_bind(&"[::1]:29500".parse().unwrap(), &Secret::none()).unwrap();
    assert!(check_bind(&"10.1.2.3:1".parse().unwrap(), &Secret::none()).is_err());
}

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
    let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| OsString::from(v))
}

#[test]
fn the_secret_comes_from_the_variable_or_the_file_without_its_newline() {
    assert_eq!(Secret::from_vars(vars(&[])).unwrap(), Secret::none());
    assert_eq!(Secret::from_vars(vars(&[(SECRET_VAR, "abc")])).unwrap(), secret("abc"));
    let dir = std::env::temp_dir().join(format!("regflow-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    std::fs::write(&file, "from-file\r\n").unwrap();
    let from_file = Secret::from_vars(vars(&[(SECRET_FILE_VAR, file.to_str().unwrap())])).unwrap();
    assert_eq!(from_file, secret("from-file"));
    assert_eq!(format!("{from_file:?}"), "Secret(set)");
    assert_eq!(format!("{:?}", Secret::none()), "Secret(none)");

    std::fs::write(&file, "\n").unwrap();
    let empty = Secret::from_vars(vars(&[(SECRET_FILE_VAR, file.to_str().unwrap())])).unwrap_err().to_string();
    assert_eq!(empty, format!("cannot use REGFLOW_SECRET_FILE={}: it is empty", file.display()));
    let missing = dir.join("missing");
    let error = Secret::from_vars(vars(&[(SECRET_FILE_VAR, missing.to_str().unwrap())])).unwrap_err().to_string();
    assert!(error.starts_with(&format!("cannot use REGFLOW_SECRET_FILE={}: ", missing.display())), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();

    assert!(matches!(Secret::from_vars(vars(&[(SECRET_VAR, "")])), Err(HandshakeError::EmptySecret)));
    let both = vars(&[(SECRET_VAR, "a"), (SECRET_FILE_VAR, "/x")]);
    assert!(matches!(Secret::from_vars(both), Err(HandshakeError::SecretConflict)));
}

#[test]
fn keyed_hmac_matches_rfc_4231() {
    let hex = |mac: HmacSha256| mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect::<String>();
    let mut short_key = keyed_hmac(&[0x0b; 20]);
    short_key.update(b"Hi There");
    assert_eq!(hex(short_key), "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    let mut long_key = keyed_hmac(&[0xaa; 131]);
    long_key.update(b"Test Using Larger Than Block-Size Key - Hash Key First");
    assert_eq!(hex(long_key), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

#[test]
fn the_build_names_version_and_target() {
    let build = Identity::build_id();
    assert_eq!(build, format!("regflow 0.1.0 {}-{}", std::env::consts::ARCH, std::env::consts::OS));
    assert!(!local_host().is_empty());
}
