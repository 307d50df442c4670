//! Frames from a hostile peer: any bytes decode to a header or an error, never a panic.
//!
//! Arbitrary bytes, valid frames with bytes overwritten, and truncated frames go to
//! `frame::decode` and to `FrameReader::read_header`; both must agree, and every header they
//! return must encode and decode back to itself. Cases per property: `REGFLOW_FUZZ_CASES`
//! (default 2000). A long deterministic run is `examples/fuzz_frames.rs` (figures in BENCHMARKS.md, "Issue 15: frame decoder fuzzing").

use proptest::prelude::*;
use regflow_net::frame::{decode, encode, FrameError, FrameReader, Header, Hello, WireBody, WireMessage};

fn wire_body() -> impl Strategy<Value = WireBody> {
    prop_oneof![
        (any::<u32>(), any::<u32>(), any::<u64>(), 0u64..64).prop_map(|(desc, slot, piece, len)| WireBody::Ready {
            desc,
            slot,
            piece,
            len
        }),
        (any::<u32>(), any::<u32>()).prop_map(|(desc, slot)| WireBody::Ack { desc, slot }),
        any::<u32>().prop_map(|desc| WireBody::Eord { desc }),
    ]
}

fn header() -> impl Strategy<Value = Header> {
    let hello =
        ((any::<u32>(), ".{0,24}", "[0-9a-f]{0,64}"), (any::<u32>(), any::<u32>(), ".{0,16}", any::<[u8; 32]>()))
            .prop_map(|((protocol, build, plan), (rank, world, host, nonce))| {
                Header::Hello(Hello { protocol, build, plan, rank, world, host, nonce })
            });
    prop_oneof![
        hello,
        any::<[u8; 32]>().prop_map(|mac| Header::Proof { mac }),
        ".{0,64}".prop_map(|reason| Header::Refused { reason }),
        (any::<u64>(), any::<u64>(), wire_body()).prop_map(|(dst, src, body)| Header::Actor(WireMessage {
            dst,
            src,
            body
        })),
        (any::<u32>(), any::<u64>(), any::<u32>(), 0u64..64).prop_map(|(group, round, rank, len)| Header::Collective {
            group,
            round,
            rank,
            len
        }),
        ".{0,64}".prop_map(|reason| Header::Abort { reason }),
        Just(Header::Bye),
        any::<u64>().prop_map(|fires| Header::Heartbeat { fires }),
        Just(Header::SnapshotRequest),
        (any::<u32>(), any::<u64>(), any::<u32>(), 0u64..64).prop_map(|(group, round, step, len)| Header::Ring {
            group,
            round,
            step,
            len
        }),
        (0u64..64).prop_map(|len| Header::Snapshot { len }),
    ]
}

/// Decodes `bytes` both ways and checks they agree, that a header re-encodes to itself, and
/// that the reader walks a stream of frames to its end or an error.
fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
    let decoded = decode(bytes);
    if let Ok((header, used)) = &decoded {
        prop_assert!(*used <= bytes.len());
        let again = encode(header).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&decode(&again).map_err(|e| TestCaseError::fail(e.to_string()))?.0, header);
    }
    let mut reader = FrameReader::new(bytes);
    let first = reader.read_header();
    match (&decoded, &first) {
        (Ok((a, _)), Ok(Some(b))) => prop_assert_eq!(a, b),
        (Err(FrameError::Truncated { what: "length" }), Ok(None)) => prop_assert!(bytes.is_empty()),
        (Err(a), Err(b)) => prop_assert_eq!(std::mem::discriminant(a), std::mem::discriminant(b)),
        _ => prop_assert!(false, "decode gave {decoded:?}, the reader {first:?}"),
    }
    // Walk on: every header's payload skipped, until the end or an error.
    let mut header = first;
    while let Ok(Some(current)) = header {
        let again = encode(&current).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decode(&again).map_err(|e| TestCaseError::fail(e.to_string()))?.0, current.clone());
        if reader.skip_payload(current.payload_len()).is_err() {
            break;
        }
        header = reader.read_header();
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("REGFLOW_FUZZ_CASES").ok().and_then(|cases| cases.parse().ok()).unwrap_or(2000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        check(&bytes)?;
    }

    #[test]
    fn small_length_prefixes_with_arbitrary_bodies_never_panic(
        len in 0u32..96,
        body in proptest::collection::vec(any::<u8>(), 0..128),
    ) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&body);
        check(&bytes)?;
    }

    #[test]
    fn valid_frames_decode_to_themselves(header in header()) {
        let bytes = encode(&header).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?, (header, bytes.len()));
    }

    #[test]
    fn corrupted_valid_frames_never_panic(
        header in header(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut bytes = encode(&header).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (at, value) in flips {
            let at = at.index(bytes.len());
            bytes[at] = value;
        }
        check(&bytes)?;
    }

    #[test]
    fn truncated_valid_frames_are_errors_not_panics(header in header(), cut in any::<prop::sample::Index>()) {
        let bytes = encode(&header).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let cut = cut.index(bytes.len());
        check(&bytes[..cut])?;
        prop_assert!(decode(&bytes[..cut]).is_err());
    }

    #[test]
    fn streams_of_frames_with_payloads_read_back_in_order(
        headers in proptest::collection::vec(header(), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut stream = Vec::new();
        for header in &headers {
            stream.extend(encode(header).map_err(|e| TestCaseError::fail(e.to_string()))?);
            stream.extend(std::iter::repeat_n(0xa5, header.payload_len() as usize));
        }
        let mut reader = FrameReader::new(stream.as_slice());
        for header in &headers {
            prop_assert_eq!(reader.read_header().map_err(|e| TestCaseError::fail(e.to_string()))?, Some(header.clone()));
            reader.skip_payload(header.payload_len()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        prop_assert!(reader.read_header().map_err(|e| TestCaseError::fail(e.to_string()))?.is_none());
        check(&stream[..cut.index(stream.len())])?;
    }
}
