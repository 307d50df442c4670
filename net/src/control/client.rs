//! The blocking client every rank (rank 0 included) uses to reach the control server.

use super::{encode_message, read_message, write_message, ControlError, ControlReply, ControlRequest, WireError};
use crate::handshake::{handshake, Expect, Identity, Secret};
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// How much longer than a request's own timeout the client waits for the server's answer.
const REPLY_MARGIN: Duration = Duration::from_secs(2);

/// The shortest socket timeout the client sets (for the handshake and for `set`).
const MIN_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// A rank's connection to the control plane. Every call waits at most its timeout plus a
/// margin; after a failed call the connection refuses further calls
/// ([`ControlError::Broken`]), since a late reply would answer the wrong request.
#[derive(Debug)]
pub struct ControlClient {
    stream: TcpStream,
    master: String,
    world: u32,
    io_timeout: Duration,
    broken: bool,
}

impl ControlClient {
    /// Connects to the master (`host:port`) as `me` and joins the control plane. Retries
    /// until `timeout` while nothing listens there (the master may start later), then fails
    /// naming the master and the last error.
    pub fn connect(
        master: &str,
        me: &Identity,
        secret: &Secret,
        timeout: Duration,
    ) -> Result<ControlClient, ControlError> {
        let mut stream = connect_with_retry(master, timeout)?;
        let io_timeout = timeout.max(MIN_IO_TIMEOUT);
        let lost = |e: io::Error| ControlError::Lost {
            master: master.to_string(),
            during: "the handshake".to_string(),
            reason: super::describe_io(&e),
        };
        stream.set_read_timeout(Some(io_timeout)).map_err(lost)?;
        stream.set_write_timeout(Some(io_timeout)).map_err(lost)?;
        // Requests are small and each one is awaited: send them at once.
        stream.set_nodelay(true).map_err(lost)?;
        // Ranks agree on the plan through the control plane, so it is not checked here.
        let me = Identity { plan: String::new(), ..me.clone() };
        handshake(&mut stream, &me, secret, Expect::Rank(0))
            .map_err(|e| ControlError::Handshake { master: master.to_string(), source: Box::new(e) })?;
        let mut client =
            ControlClient { stream, master: master.to_string(), world: me.world, io_timeout, broken: false };
        match client.receive("joining", io_timeout)? {
            ControlReply::Joined => Ok(client),
            ControlReply::Refused { reason } => Err(ControlError::Refused { master: client.master, reason }),
            other => Err(client.unexpected("joining", &other)),
        }
    }

    /// The master's address, as given to [`ControlClient::connect`].
    pub fn master(&self) -> &str {
        &self.master
    }

    /// Sets `key` to `value` for every rank to [`get`](ControlClient::get).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), ControlError> {
        let during = format!("set '{key}'");
        match self.call(
            &ControlRequest::Set { key: key.to_string(), value: value.to_vec() },
            &during,
            Duration::ZERO,
        )? {
            ControlReply::Done => Ok(()),
            other => Err(self.unexpected(&during, &other)),
        }
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, ControlError> {
        let during = format!("get '{key}'");
        let request = ControlRequest::Get { key: key.to_string(), timeout_ms: millis(timeout) };
        match self.call(&request, &during, timeout)? {
            ControlReply::Value(value) => Ok(value),
            ControlReply::GetTimedOut => Err(ControlError::GetTimedOut { key: key.to_string(), after: timeout }),
            other => Err(self.unexpected(&during, &other)),
        }
    }

    /// Waits until every rank arrived at barrier `name`, up to `timeout`. A timeout names the
    /// ranks that did not arrive; a rank leaving the control plane fails it at once.
    pub fn barrier(&mut self, name: &str, timeout: Duration) -> Result<(), ControlError> {
        let during = format!("barrier '{name}'");
        let request = ControlRequest::Barrier { name: name.to_string(), timeout_ms: millis(timeout) };
        match self.call(&request, &during, timeout)? {
            ControlReply::Done => Ok(()),
            ControlReply::BarrierTimedOut { missing, arrived, never_joined } => Err(ControlError::BarrierTimedOut {
                name: name.to_string(),
                after: timeout,
                world: self.world,
                missing,
                arrived,
                never_joined,
            }),
            ControlReply::RankLeft { rank, host } => {
                Err(ControlError::RankLeft { rank, host, barrier: name.to_string() })
            }
            other => Err(self.unexpected(&during, &other)),
        }
    }

    /// Sends `request` and reads its reply, waiting `wait` (the request's own timeout) plus
    /// the margin, at least the client's io timeout.
    fn call(&mut self, request: &ControlRequest, during: &str, wait: Duration) -> Result<ControlReply, ControlError> {
        if self.broken {
            return Err(ControlError::Broken { master: self.master.clone() });
        }
        let frame = match encode_message(request) {
            Ok(frame) => frame,
            Err(WireError::TooLarge(len)) => return Err(ControlError::TooLarge { what: during.to_string(), len }),
            Err(e) => return Err(self.protocol(during, e.to_string())),
        };
        // Until the reply is read, the connection is out of step.
        self.broken = true;
        let sent = self.stream.set_write_timeout(Some(self.io_timeout)).map_err(WireError::from);
        sent.and_then(|()| write_message(&mut self.stream, &frame))
            .map_err(|e| self.failed(during, e, self.io_timeout))?;
        let reply = self.receive(during, (wait + REPLY_MARGIN).max(self.io_timeout))?;
        self.broken = false;
        Ok(reply)
    }

    fn receive(&mut self, during: &str, wait: Duration) -> Result<ControlReply, ControlError> {
        self.stream.set_read_timeout(Some(wait)).map_err(|e| self.failed(during, e.into(), wait))?;
        match read_message(&mut self.stream) {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(ControlError::Lost {
                master: self.master.clone(),
                during: during.to_string(),
                reason: "the master closed the connection".to_string(),
            }),
            Err(e) => Err(self.failed(during, e, wait)),
        }
    }

    /// Sends `request` and does not wait for the reply: a rank that goes away mid-request.
    #[cfg(test)]
    pub(super) fn send_and_leave(mut self, request: &ControlRequest) {
        use std::io::Write;
        let frame = encode_message(request).unwrap();
        self.stream.write_all(&frame).unwrap();
    }

    fn failed(&self, during: &str, error: WireError, waited: Duration) -> ControlError {
        let (master, during) = (self.master.clone(), during.to_string());
        match error {
            e if e.is_timeout() => ControlError::Silent { master, during, after: waited },
            WireError::Malformed(reason) => ControlError::Protocol { master, during, reason },
            e => ControlError::Lost { master, during, reason: e.to_string() },
        }
    }

    fn protocol(&self, during: &str, reason: String) -> ControlError {
        ControlError::Protocol { master: self.master.clone(), during: during.to_string(), reason }
    }

    fn unexpected(&self, during: &str, reply: &ControlReply) -> ControlError {
        self.protocol(during, format!("the reply {reply:?} does not answer it"))
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Connects to `master`, retrying with growing pauses until `timeout` passes.
fn connect_with_retry(master: &str, timeout: Duration) -> Result<TcpStream, ControlError> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let last_error = match master.to_socket_addrs() {
            Ok(addrs) => {
                let mut last_error = "its name resolves to no address".to_string();
                for addr in addrs {
                    match TcpStream::connect_timeout(&addr, remaining) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last_error = super::describe_io(&e),
                    }
                }
                last_error
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                return Err(ControlError::BadMaster { master: master.to_string(), reason: e.to_string() })
            }
            // Name resolution may fail while the master's host is still coming up.
            Err(e) => format!("its name does not resolve: {e}"),
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(ControlError::Unreachable { master: master.to_string(), after: timeout, reason: last_error });
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}
