//! The cluster's shared secret, from `REGFLOW_SECRET` or the file `REGFLOW_SECRET_FILE` names.

use super::HandshakeError;
use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::path::PathBuf;

/// The variable holding the secret itself (its bytes are the key).
pub const SECRET_VAR: &str = "REGFLOW_SECRET";

/// The variable naming a file that holds the secret (a trailing newline is not part of it).
pub const SECRET_FILE_VAR: &str = "REGFLOW_SECRET_FILE";

/// Longest secret file read; a secret is a short random string, not a document.
const MAX_SECRET_FILE_BYTES: u64 = 64 * 1024;

/// The key every node of a job proves it knows in the handshake. Its `Debug` shows only
/// whether it is set.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret {
    key: Vec<u8>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_set() { "Secret(set)" } else { "Secret(none)" })
    }
}

impl Secret {
    /// No secret: handshakes prove the empty key, and nodes listen on loopback only.
    pub fn none() -> Secret {
        Secret { key: Vec::new() }
    }

    /// The secret `key` (empty means none).
    pub fn new(key: impl Into<Vec<u8>>) -> Secret {
        Secret { key: key.into() }
    }

    /// Whether a secret is set.
    pub fn is_set(&self) -> bool {
        !self.key.is_empty()
    }

    /// The secret from the process environment: the bytes of `REGFLOW_SECRET`, or the
    /// contents of the file `REGFLOW_SECRET_FILE` names; none when neither is set.
    pub fn from_env() -> Result<Secret, HandshakeError> {
        Secret::from_vars(|name| std::env::var_os(name))
    }

    /// [`Secret::from_env`] with the variables looked up through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<OsString>) -> Result<Secret, HandshakeError> {
        match (get(SECRET_VAR), get(SECRET_FILE_VAR)) {
            (Some(_), Some(_)) => Err(HandshakeError::SecretConflict),
            (Some(value), None) if value.is_empty() => Err(HandshakeError::EmptySecret),
            (Some(value), None) => Ok(Secret::new(value.into_encoded_bytes())),
            (None, Some(path)) => read_secret_file(PathBuf::from(path)),
            (None, None) => Ok(Secret::none()),
        }
    }

    pub(super) fn key(&self) -> &[u8] {
        &self.key
    }
}

fn read_secret_file(path: PathBuf) -> Result<Secret, HandshakeError> {
    let failed = |reason: String| HandshakeError::SecretFile { path: path.clone(), reason };
    let file = std::fs::File::open(&path).map_err(|e| failed(e.to_string()))?;
    let mut key = Vec::new();
    file.take(MAX_SECRET_FILE_BYTES + 1).read_to_end(&mut key).map_err(|e| failed(e.to_string()))?;
    if key.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(failed(format!(
            "it is longer than {MAX_SECRET_FILE_BYTES} bytes; a secret is a short random string"
        )));
    }
    while key.last().is_some_and(|byte| matches!(byte, b'\n' | b'\r')) {
        key.pop();
    }
    if key.is_empty() {
        return Err(failed("it is empty".to_string()));
    }
    Ok(Secret::new(key))
}
