//! Short byte strings held in place: the pending changes' keys and versions. A checkpoint's
//! map holds one per key changed, and a lookup compares the key it probes; held in the map's
//! own slot, that comparison reads memory the probe has just loaded instead of following a
//! pointer to an allocation of its own, and a change of a short key allocates nothing for it.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

/// Bytes held in place up to this length (the value is 24 bytes, as a `Vec<u8>` is).
const INLINE: usize = 22;

/// A byte string: in place when short, else in an allocation of its own. It hashes, compares
/// and orders as its bytes do, so maps keyed by it are looked up with a `&[u8]`.
#[derive(Clone)]
pub enum InlineBytes {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<[u8]>),
}

impl InlineBytes {
    /// The bytes held outside the value itself.
    pub fn heap_len(&self) -> usize {
        match self {
            InlineBytes::Inline { .. } => 0,
            InlineBytes::Heap(b) => b.len(),
        }
    }
}

impl Default for InlineBytes {
    fn default() -> Self {
        InlineBytes::from(&[][..])
    }
}

impl From<&[u8]> for InlineBytes {
    fn from(b: &[u8]) -> Self {
        if b.len() <= INLINE {
            let mut bytes = [0; INLINE];
            bytes[..b.len()].copy_from_slice(b);
            InlineBytes::Inline {
                len: b.len() as u8,
                bytes,
            }
        } else {
            InlineBytes::Heap(b.into())
        }
    }
}

impl From<Vec<u8>> for InlineBytes {
    fn from(v: Vec<u8>) -> Self {
        if v.len() <= INLINE {
            InlineBytes::from(v.as_slice())
        } else {
            InlineBytes::Heap(v.into_boxed_slice())
        }
    }
}

impl Deref for InlineBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            InlineBytes::Inline { len, bytes } => &bytes[..*len as usize],
            InlineBytes::Heap(b) => b,
        }
    }
}

impl Borrow<[u8]> for InlineBytes {
    fn borrow(&self) -> &[u8] {
        self
    }
}

impl Hash for InlineBytes {
    /// As `[u8]` hashes, which `Borrow` requires.
    fn hash<H: Hasher>(&self, state: &mut H) {
        (**self).hash(state)
    }
}

impl PartialEq for InlineBytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for InlineBytes {}

impl PartialOrd for InlineBytes {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InlineBytes {
    fn cmp(&self, other: &Self) -> Ordering {
        (**self).cmp(&**other)
    }
}

impl std::fmt::Debug for InlineBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn holds_compares_and_hashes_as_its_bytes_do() {
        assert_eq!(std::mem::size_of::<InlineBytes>(), 24);
        let samples: Vec<Vec<u8>> = (0..=40usize)
            .map(|n| (0..n).map(|i| (i * 37 + n) as u8).collect())
            .chain([vec![0; 22], vec![255; 22], vec![0; 23], vec![255; 23]])
            .collect();
        let mut map = HashMap::new();
        for s in &samples {
            let b = InlineBytes::from(s.clone());
            assert_eq!(&*b, s.as_slice());
            assert_eq!(&*InlineBytes::from(s.as_slice()), s.as_slice());
            assert_eq!(b.heap_len(), if s.len() > INLINE { s.len() } else { 0 });
            map.insert(b, s.len());
        }
        for s in &samples {
            assert_eq!(map.get(s.as_slice()), Some(&s.len()), "{s:?}");
            for t in &samples {
                let (a, b) = (
                    InlineBytes::from(s.as_slice()),
                    InlineBytes::from(t.as_slice()),
                );
                assert_eq!(a.cmp(&b), s.cmp(t));
                assert_eq!(a == b, s == t);
            }
        }
    }
}
