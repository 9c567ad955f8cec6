//! An on-disk cache of compiled kernels, so that only a process's first use on a machine pays
//! the runtime compiler (NVRTC takes tens of seconds on `small_seq.cu`, and every CLI command
//! and test binary is a new process).
//!
//! An entry is keyed by everything the compiler's output depends on: the kernel's name, its
//! full source, the compile options and the compiler's version. The key is stored in the entry
//! and compared whole on lookup, so a hash collision, a truncated file or a stale format is a
//! miss, never a wrong kernel. Entries are written to a temporary file and renamed into place:
//! concurrent processes see either no entry or a whole one.
//!
//! The cache is an optimisation only: no lookup or store error fails a compile.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable naming the cache directory (`off` or `0` disables the cache).
pub const CACHE_ENV: &str = "SMALLSEQ_KERNEL_CACHE";
/// Entries kept per directory; storing one more removes the least recently written.
pub const MAX_ENTRIES: usize = 24;
const MAGIC: &[u8] = b"smallseq-kernel-cache v1\n";
const SUFFIX: &str = ".kernel";

/// Where compiled kernels are kept, or nowhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    /// A cache in `dir` (`None`: disabled).
    pub fn at(dir: Option<PathBuf>) -> Self {
        KernelCache { dir }
    }

    /// The cache the environment asks for: `SMALLSEQ_KERNEL_CACHE` (a directory, or `off`/`0`),
    /// else `$XDG_CACHE_HOME/smallseq/kernels`, else `$HOME/.cache/smallseq/kernels`.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var_os(k))
    }

    /// As [`KernelCache::from_env`] over the variables `var` returns.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Self {
        let var = |k: &str| var(k).filter(|v| !v.is_empty());
        let dir = match var(CACHE_ENV) {
            Some(v) if v == "off" || v == "0" => None,
            Some(v) => Some(PathBuf::from(v)),
            None => var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache")))
                .map(|c| c.join("smallseq").join("kernels")),
        };
        KernelCache { dir }
    }

    /// The directory, when the cache is enabled.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The file an entry for `key` lives in; `name` (the kernel file's) makes it readable.
    pub fn entry_path(&self, name: &str, key: &[u8]) -> Option<PathBuf> {
        let stem: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let dir = self.dir.as_ref()?;
        Some(dir.join(format!("{stem}-{}{SUFFIX}", fingerprint(key))))
    }

    /// The stored value for `key`, if a whole entry with exactly this key exists. A hit
    /// counts as a use: pruning removes the least recently used entries.
    pub fn load(&self, name: &str, key: &[u8]) -> Option<Vec<u8>> {
        let path = self.entry_path(name, key)?;
        let value = decode(&std::fs::read(&path).ok()?, key)?;
        let _ = std::fs::File::options()
            .append(true)
            .open(&path)
            .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        Some(value)
    }

    /// Stores `value` under `key` and prunes the directory to [`MAX_ENTRIES`].
    ///
    /// # Errors
    /// The I/O error of creating the directory or writing the entry (the caller carries on
    /// without the cache).
    pub fn store(&self, name: &str, key: &[u8], value: &[u8]) -> std::io::Result<PathBuf> {
        let (Some(dir), Some(path)) = (self.dir.as_ref(), self.entry_path(name, key)) else {
            return Err(std::io::Error::other("the kernel cache is disabled"));
        };
        std::fs::create_dir_all(dir)?;
        // Unique per process and store, so concurrent writers never share a temporary file.
        static STORES: AtomicU64 = AtomicU64::new(0);
        let tmp = dir.join(format!(
            ".{}.{}-{}.tmp",
            path.file_name().and_then(|f| f.to_str()).unwrap_or("entry"),
            std::process::id(),
            STORES.fetch_add(1, Ordering::Relaxed)
        ));
        let written = std::fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(&encode(key, value))?;
            f.sync_all()
        });
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        prune(dir, MAX_ENTRIES);
        Ok(path)
    }
}

/// `MAGIC`, the key's and the value's lengths (u64 little-endian), the key, the value.
fn encode(key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + 16 + key.len() + value.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(key.len() as u64).to_le_bytes());
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(value);
    out
}

fn decode(bytes: &[u8], key: &[u8]) -> Option<Vec<u8>> {
    let rest = bytes.strip_prefix(MAGIC)?;
    let len = |b: &[u8]| -> Option<usize> {
        usize::try_from(u64::from_le_bytes(b.try_into().ok()?)).ok()
    };
    let (key_len, value_len) = (len(rest.get(..8)?)?, len(rest.get(8..16)?)?);
    let rest = &rest[16..];
    if key_len != key.len() || rest.len() != key_len.checked_add(value_len)? {
        return None;
    }
    let (stored_key, value) = rest.split_at(key_len);
    (stored_key == key).then(|| value.to_vec())
}

/// Removes the least recently used entries beyond `keep`, and temporary files a store that
/// died left behind (older than an hour: a live store is seconds old).
fn prune(dir: &Path, keep: usize) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    let aged = |p: &Path| {
        let m = std::fs::metadata(p).ok()?.modified().ok()?;
        Some((m, m.elapsed().unwrap_or_default()))
    };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for p in read.filter_map(|e| e.ok()).map(|e| e.path()) {
        let Some((modified, age)) = aged(&p) else {
            continue;
        };
        match p.extension().and_then(|x| x.to_str()) {
            Some(x) if x == &SUFFIX[1..] => entries.push((modified, p)),
            Some("tmp") if age > std::time::Duration::from_secs(3600) => {
                let _ = std::fs::remove_file(&p);
            }
            _ => {}
        }
    }
    if entries.len() <= keep {
        return;
    }
    entries.sort();
    for (_, p) in &entries[..entries.len() - keep] {
        let _ = std::fs::remove_file(p);
    }
}

/// A short identity of a kernel build (its cache key, or a code object's bytes) for
/// provenance records: FNV-1a, 64 bits, in hex. Not collision-proof; names, never decides.
pub fn fingerprint(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a(bytes))
}

/// FNV-1a, 64 bits: names the entry's file only (the key itself is compared on lookup).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_cache(tag: &str) -> KernelCache {
        let dir = std::env::temp_dir().join(format!(
            "smallseq-kernel-cache-test-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        KernelCache::at(Some(dir))
    }

    #[test]
    fn a_stored_entry_loads_under_its_key_only() {
        let c = temp_cache("roundtrip");
        assert_eq!(c.load("k.cu", b"key-a"), None);
        let path = c.store("k.cu", b"key-a", b"ptx text").expect("store");
        assert!(path.starts_with(c.dir().unwrap()), "{}", path.display());
        assert_eq!(c.load("k.cu", b"key-a").as_deref(), Some(&b"ptx text"[..]));
        assert_eq!(c.load("k.cu", b"key-b"), None);
        // Same file name, different key (what a hash collision looks like): a miss.
        std::fs::write(
            c.entry_path("k.cu", b"key-b").unwrap(),
            encode(b"key-a", b"x"),
        )
        .unwrap();
        assert_eq!(c.load("k.cu", b"key-b"), None);
        let _ = std::fs::remove_dir_all(c.dir().unwrap());
    }

    #[test]
    fn a_damaged_entry_is_a_miss() {
        let c = temp_cache("damaged");
        let path = c.store("k.cu", b"key", b"0123456789").expect("store");
        let whole = std::fs::read(&path).unwrap();
        for cut in [0, 5, MAGIC.len() + 3, whole.len() - 1] {
            std::fs::write(&path, &whole[..cut]).unwrap();
            assert_eq!(c.load("k.cu", b"key"), None, "cut at {cut}");
        }
        let mut longer = whole.clone();
        longer.push(b'!');
        std::fs::write(&path, &longer).unwrap();
        assert_eq!(c.load("k.cu", b"key"), None, "trailing byte");
        let mut lying = whole.clone();
        lying[MAGIC.len()..MAGIC.len() + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&path, &lying).unwrap();
        assert_eq!(c.load("k.cu", b"key"), None, "huge key length");
        std::fs::write(&path, &whole).unwrap();
        assert_eq!(c.load("k.cu", b"key").as_deref(), Some(&b"0123456789"[..]));
        let _ = std::fs::remove_dir_all(c.dir().unwrap());
    }

    #[test]
    fn the_directory_keeps_the_newest_entries() {
        let c = temp_cache("prune");
        let dir = c.dir().unwrap().to_path_buf();
        for i in 0..MAX_ENTRIES + 3 {
            c.store("k.cu", format!("key-{i}").as_bytes(), b"v")
                .expect("store");
            // Distinct modification times, oldest first.
            let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(i as u64);
            let f = std::fs::File::options()
                .append(true)
                .open(c.entry_path("k.cu", format!("key-{i}").as_bytes()).unwrap())
                .unwrap();
            f.set_modified(t).unwrap();
        }
        let left = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(left, MAX_ENTRIES);
        assert_eq!(c.load("k.cu", b"key-0"), None, "the oldest went first");
        let newest = format!("key-{}", MAX_ENTRIES + 2);
        assert!(c.load("k.cu", newest.as_bytes()).is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_hit_is_a_use_and_dead_stores_are_swept() {
        let c = temp_cache("lru");
        let dir = c.dir().unwrap().to_path_buf();
        let set_time = |p: &Path, secs: u64| {
            let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs);
            std::fs::File::options()
                .append(true)
                .open(p)
                .unwrap()
                .set_modified(t)
                .unwrap();
        };
        for i in 0..MAX_ENTRIES {
            let key = format!("key-{i}");
            let path = c.store("k.cu", key.as_bytes(), b"v").expect("store");
            set_time(&path, i as u64);
        }
        // The oldest entry is read: it is the newest use now.
        assert!(c.load("k.cu", b"key-0").is_some());
        let dead = dir.join(".k_cu-dead.1-0.tmp");
        let live = dir.join(".k_cu-live.2-0.tmp");
        std::fs::write(&dead, b"half").unwrap();
        std::fs::write(&live, b"half").unwrap();
        set_time(&dead, 0);
        c.store("k.cu", b"key-new", b"v").expect("store");
        assert!(
            c.load("k.cu", b"key-0").is_some(),
            "a used entry was pruned"
        );
        assert_eq!(
            c.load("k.cu", b"key-1"),
            None,
            "the least recently used stays"
        );
        assert!(!dead.exists(), "an hour-old temporary file stays");
        assert!(live.exists(), "a store in progress lost its file");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_directory_follows_the_environment() {
        let from = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            KernelCache::from_vars(|k| {
                vars.iter()
                    .find(|(n, _)| n == k)
                    .map(|(_, v)| OsString::from(v))
            })
            .dir()
            .map(Path::to_path_buf)
        };
        let home = [("HOME", "/h")];
        assert_eq!(
            from(&home),
            Some(PathBuf::from("/h/.cache/smallseq/kernels"))
        );
        let xdg = [("HOME", "/h"), ("XDG_CACHE_HOME", "/x")];
        assert_eq!(from(&xdg), Some(PathBuf::from("/x/smallseq/kernels")));
        let set = [("HOME", "/h"), (CACHE_ENV, "/c")];
        assert_eq!(from(&set), Some(PathBuf::from("/c")));
        assert_eq!(from(&[("HOME", "/h"), (CACHE_ENV, "off")]), None);
        assert_eq!(from(&[("HOME", "/h"), (CACHE_ENV, "")]), from(&home));
        assert_eq!(from(&[]), None);
    }

    #[test]
    fn a_disabled_or_unwritable_cache_stores_nothing_and_misses() {
        let off = KernelCache::at(None);
        assert!(off.store("k.cu", b"key", b"v").is_err());
        assert_eq!(off.load("k.cu", b"key"), None);
        // A regular file where the directory should be.
        let file = std::env::temp_dir().join(format!("smallseq-cache-file-{}", std::process::id()));
        std::fs::write(&file, b"not a directory").unwrap();
        let blocked = KernelCache::at(Some(file.clone()));
        assert!(blocked.store("k.cu", b"key", b"v").is_err());
        assert_eq!(blocked.load("k.cu", b"key"), None);
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn concurrent_stores_leave_a_whole_entry() {
        let c = temp_cache("concurrent");
        let value: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| c.store("k.cu", b"key", &value).expect("store"));
            }
        });
        assert_eq!(c.load("k.cu", b"key"), Some(value));
        let _ = std::fs::remove_dir_all(c.dir().unwrap());
    }
}
