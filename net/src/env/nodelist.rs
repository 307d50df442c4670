//! Slurm's compressed host lists (`node[1-3,7]`, `gpu[01-03]`, `rack[1-2]-node[1-2]`).

use super::EnvError;

/// The most hosts a node list may expand to; a longer one is an error, not an allocation.
pub const MAX_NODELIST_HOSTS: usize = 65_536;

/// One piece of a host pattern: literal text, or a bracket group of numbers.
enum Piece<'a> {
    Text(&'a str),
    Numbers(Vec<Range>),
}

/// `lo-hi` (or one number, `lo == hi`), printed `width` digits wide with leading zeros.
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    fn count(&self) -> u64 {
        // lo <= hi, checked when parsed; a full-u64 range saturates and is refused by the cap.
        (self.hi - self.lo).saturating_add(1)
    }
}

/// Expands a Slurm host list into host names, in order: `node[1-3,7]` is node1 node2 node3
/// node7, `gpu[01-03]` keeps the padding (gpu01 gpu02 gpu03), `a,b[1-2],c` is a b1 b2 c, and
/// several bracket groups give every combination, the last group varying fastest
/// (`rack[1-2]-node[1-2]` is rack1-node1 rack1-node2 rack2-node1 rack2-node2).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, EnvError> {
    let malformed = |reason: String| EnvError::Nodelist { list: list.to_string(), reason };
    let too_many = || EnvError::TooManyHosts { list: list.to_string() };
    if list.trim().is_empty() {
        return Err(malformed("it is empty".to_string()));
    }
    let patterns = split_hosts(list.trim()).map_err(malformed)?;
    let mut parsed = Vec::with_capacity(patterns.len());
    let mut total: u64 = 0;
    for pattern in patterns {
        if pattern.is_empty() {
            return Err(malformed("it has an empty host name (two commas in a row, or one at an end)".to_string()));
        }
        let pieces = parse_pattern(pattern).map_err(malformed)?;
        let hosts = pieces.iter().try_fold(1u64, |hosts, piece| match piece {
            Piece::Text(_) => Some(hosts),
            Piece::Numbers(ranges) => {
                hosts.checked_mul(ranges.iter().map(Range::count).try_fold(0u64, u64::checked_add)?)
            }
        });
        total = hosts.and_then(|hosts| total.checked_add(hosts)).ok_or_else(too_many)?;
        if total > MAX_NODELIST_HOSTS as u64 {
            return Err(too_many());
        }
        parsed.push(pieces);
    }
    let mut names = Vec::with_capacity(total as usize);
    for pieces in &parsed {
        names.extend(expand_pattern(pieces));
    }
    Ok(names)
}

/// Splits at the commas outside brackets, checking that brackets pair up and do not nest.
fn split_hosts(list: &str) -> Result<Vec<&str>, String> {
    let mut patterns = Vec::new();
    let (mut start, mut open) = (0, None);
    for (at, c) in list.char_indices() {
        match (c, open) {
            ('[', Some(_)) => return Err(format!("a '[' at byte {at} opens inside another bracket group")),
            ('[', None) => open = Some(at),
            (']', None) => return Err(format!("the ']' at byte {at} closes no '['")),
            (']', Some(_)) => open = None,
            (',', None) => {
                patterns.push(&list[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    if let Some(at) = open {
        return Err(format!("the '[' at byte {at} is never closed"));
    }
    patterns.push(&list[start..]);
    Ok(patterns)
}

/// Parses one host pattern (no top-level commas, brackets balanced) into pieces.
fn parse_pattern(pattern: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut rest = pattern;
    while let Some(open) = rest.find('[') {
        let close =
            rest[open..].find(']').map(|at| open + at).ok_or_else(|| format!("'{pattern}' has an unclosed '['"))?;
        if open > 0 {
            pieces.push(Piece::Text(&rest[..open]));
        }
        let group = &rest[open + 1..close];
        pieces.push(Piece::Numbers(group.split(',').map(|range| parse_range(range, group)).collect::<Result<_, _>>()?));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

fn parse_range(range: &str, group: &str) -> Result<Range, String> {
    let (lo, hi) = range.split_once('-').unwrap_or((range, range));
    let number = |digits: &str| -> Result<u64, String> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("'{range}' in '[{group}]' is not a number or a range of numbers"));
        }
        digits.parse().map_err(|_| format!("'{digits}' in '[{group}]' is too large"))
    };
    let (lo_value, hi_value) = (number(lo)?, number(hi)?);
    if lo_value > hi_value {
        return Err(format!("the range '{range}' in '[{group}]' runs backwards"));
    }
    Ok(Range { lo: lo_value, hi: hi_value, width: lo.len() })
}

/// Every host `pieces` describe, the last bracket group varying fastest.
fn expand_pattern(pieces: &[Piece<'_>]) -> Vec<String> {
    let mut names = vec![String::new()];
    for piece in pieces {
        match piece {
            Piece::Text(text) => names.iter_mut().for_each(|name| name.push_str(text)),
            Piece::Numbers(ranges) => {
                names = names
                    .iter()
                    .flat_map(|prefix| {
                        ranges.iter().flat_map(move |range| {
                            (range.lo..=range.hi).map(move |n| format!("{prefix}{n:0width$}", width = range.width))
                        })
                    })
                    .collect();
            }
        }
    }
    names
}
