//! A record's version: its position in the upstream change order (binlog position, LSN,
//! configured fields), and the byte encoding the index and delete files store, whose bytewise
//! order is the versions' order.

use std::fmt;

/// One component of a record version; versions compare component by component.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum VersionPart {
    Int(i128),
    Text(String),
}

/// A record's position in the upstream change order (binlog position, LSN, ...).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Version(pub Vec<VersionPart>);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            match p {
                VersionPart::Int(v) => write!(f, "{v}")?,
                VersionPart::Text(t) => f.write_str(t)?,
            }
        }
        Ok(())
    }
}

const TAG_INT: u8 = 0x01;
const TAG_TEXT: u8 = 0x02;

/// Encodes a version so that bytewise order of encodings equals the order of versions.
///
/// Each part is a tag byte (Int before Text, as [`VersionPart`] orders them) then either the
/// sign-flipped big-endian `i128` or the text with `0x00` escaped as `0x00 0xFF` and ended by
/// `0x00 0x00`. Parts are self-delimiting, so a version that is a prefix of another encodes to
/// a byte prefix of it and sorts first.
pub fn encode_version(version: &Version) -> Vec<u8> {
    // Exact unless a text part holds zero bytes (each escaped with one more).
    let len = version
        .0
        .iter()
        .map(|part| match part {
            VersionPart::Int(_) => 17,
            VersionPart::Text(t) => t.len() + 3,
        })
        .sum();
    let mut out = Vec::with_capacity(len);
    for part in &version.0 {
        match part {
            VersionPart::Int(v) => {
                out.push(TAG_INT);
                out.extend_from_slice(&((*v as u128) ^ (1 << 127)).to_be_bytes());
            }
            VersionPart::Text(t) => {
                out.push(TAG_TEXT);
                for &b in t.as_bytes() {
                    out.push(b);
                    if b == 0 {
                        out.push(0xFF);
                    }
                }
                out.extend_from_slice(&[0, 0]);
            }
        }
    }
    out
}

/// The encoding of the first `parts` parts of an encoded version; `None` if it has fewer or
/// is not an [`encode_version`] encoding.
pub fn version_prefix(encoded: &[u8], parts: usize) -> Option<&[u8]> {
    let mut at = 0;
    for _ in 0..parts {
        match *encoded.get(at)? {
            TAG_INT => at += 17,
            TAG_TEXT => {
                at += 1;
                loop {
                    match *encoded.get(at)? {
                        0 if encoded.get(at + 1) == Some(&0xFF) => at += 2,
                        0 => {
                            at += 2;
                            break;
                        }
                        _ => at += 1,
                    }
                }
            }
            _ => return None,
        }
        if at > encoded.len() {
            return None;
        }
    }
    Some(&encoded[..at])
}

/// Whether an encoded version was made to sort just after another: a complete
/// [`encode_version`] encoding followed by a zero byte, which no encoding writes.
pub fn is_successor(encoded: &[u8]) -> bool {
    let mut at = 0;
    loop {
        match encoded.get(at) {
            Some(&TAG_INT) => at += 17,
            Some(&TAG_TEXT) => match version_prefix(&encoded[at..], 1) {
                Some(part) => at += part.len(),
                None => return false,
            },
            Some(0) => return at > 0,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn part() -> impl Strategy<Value = VersionPart> {
        prop_oneof![
            prop_oneof![
                Just(i128::MIN),
                Just(-1i128),
                Just(0i128),
                Just(1i128),
                Just(i128::MAX),
                any::<i128>(),
            ]
            .prop_map(VersionPart::Int),
            "[\\x00a\\xff\u{100}]{0,3}".prop_map(VersionPart::Text),
        ]
    }

    fn version() -> impl Strategy<Value = Version> {
        prop::collection::vec(part(), 0..4).prop_map(Version)
    }

    /// Pairs that often share a prefix, where ordering bugs hide.
    fn version_pair() -> impl Strategy<Value = (Version, Version)> {
        (version(), version(), version()).prop_map(|(common, a, b)| {
            let mut x = common.clone();
            x.0.extend(a.0);
            let mut y = common;
            y.0.extend(b.0);
            (x, y)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn version_encoding_preserves_order((a, b) in version_pair()) {
            prop_assert_eq!(encode_version(&a).cmp(&encode_version(&b)), a.cmp(&b));
        }

        #[test]
        fn version_prefix_cuts_whole_parts(v in version(), n in 0usize..5) {
            let encoded = encode_version(&v);
            let want = (n <= v.0.len()).then(|| encode_version(&Version(v.0[..n].to_vec())));
            prop_assert_eq!(version_prefix(&encoded, n).map(<[u8]>::to_vec), want);
        }

        #[test]
        fn successors_are_told_from_encodings(v in version()) {
            let mut encoded = encode_version(&v);
            prop_assert!(!is_successor(&encoded));
            encoded.push(0);
            prop_assert_eq!(is_successor(&encoded), !v.0.is_empty());
        }
    }

    #[test]
    fn version_encoding_examples() {
        let int = |v| Version(vec![VersionPart::Int(v)]);
        let mut int_zero = vec![TAG_INT, 0x80];
        int_zero.extend([0; 15]);
        assert_eq!(encode_version(&int(0)), int_zero);
        assert_eq!(
            encode_version(&Version(vec![VersionPart::Text("a\0".into())])),
            vec![TAG_TEXT, b'a', 0, 0xFF, 0, 0]
        );
        assert_eq!(encode_version(&Version::default()), Vec::<u8>::new());
    }
}
