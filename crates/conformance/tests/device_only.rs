//! A device-only backend (a bump arena over a `Vec<u8>`, no pinned host
//! tier) passes the suite and a complete fault matrix without `[pinned-host]` rows.

mod arena {
    use memgov_backend::{
        lock, BackendError, BackendErrorKind, DeviceContext, DeviceDescription, Execution,
        MemoryInfo, RetireSignal,
    };
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    const NAME: &str = "bump";
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);

    pub struct BumpContext {
        id: u64,
        arena: Arc<Mutex<Arena>>,
    }
    struct Arena {
        bytes: Vec<u8>,
        top: u64,
        live: Vec<(u64, u64)>, // (offset, len) of live blocks
        streams: Vec<u64>,
        next_stream: u64,
    }
    pub struct BumpStream {
        ctx: u64,
        id: u64,
    }
    pub struct BumpMemory {
        ctx: u64,
        offset: u64,
        len: u64,
    }

    fn err(op: &'static str, kind: BackendErrorKind, msg: String) -> BackendError {
        BackendError::new(NAME, op, kind, msg)
    }

    impl BumpContext {
        pub fn new(capacity: u64) -> Result<Self, BackendError> {
            Ok(Self {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                arena: Arc::new(Mutex::new(Arena {
                    bytes: vec![0; capacity as usize],
                    top: 0,
                    live: vec![],
                    streams: vec![],
                    next_stream: 1,
                })),
            })
        }
        /// Live blocks and streams, for a leak check.
        pub fn leak_check(&self) -> impl Fn() -> Result<(), String> + 'static {
            let arena = Arc::clone(&self.arena);
            move || {
                let a = lock(&arena);
                match (a.live.len(), a.streams.len()) {
                    (0, 0) => Ok(()),
                    (b, s) => Err(format!("{b} blocks and {s} streams left after teardown")),
                }
            }
        }
        fn check_stream(
            &self,
            a: &Arena,
            s: &BumpStream,
            op: &'static str,
        ) -> Result<(), BackendError> {
            if s.ctx != self.id || !a.streams.contains(&s.id) {
                return Err(err(
                    op,
                    BackendErrorKind::InvalidArgument,
                    "stream of another context or destroyed".into(),
                ));
            }
            Ok(())
        }
        fn check_range(
            &self,
            a: &Arena,
            m: &BumpMemory,
            off: u64,
            len: usize,
            op: &'static str,
        ) -> Result<(), BackendError> {
            if m.ctx != self.id || !a.live.contains(&(m.offset, m.len)) {
                return Err(err(
                    op,
                    BackendErrorKind::InvalidArgument,
                    "memory of another context or freed".into(),
                ));
            }
            if off.checked_add(len as u64).is_none_or(|end| end > m.len) {
                return Err(err(
                    op,
                    BackendErrorKind::InvalidArgument,
                    format!("range {off}+{len} past the end of {} B", m.len),
                ));
            }
            Ok(())
        }
    }

    impl DeviceContext for BumpContext {
        type Stream = BumpStream;
        type Memory = BumpMemory;

        fn describe(&self) -> DeviceDescription {
            DeviceDescription {
                backend: NAME,
                vendor: "scratch".into(),
                name: "bump arena".into(),
                ordinal: 0,
                total_bytes: lock(&self.arena).bytes.len() as u64,
                driver: "none".into(),
                execution: Execution::Embedded,
                stream_ordered_reuse: false,
            }
        }
        fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
            let a = lock(&self.arena);
            let total = a.bytes.len() as u64;
            Ok(MemoryInfo {
                free: total - a.top,
                total,
            })
        }
        fn create_stream(&self) -> Result<BumpStream, BackendError> {
            let mut a = lock(&self.arena);
            let id = a.next_stream;
            a.next_stream += 1;
            a.streams.push(id);
            Ok(BumpStream { ctx: self.id, id })
        }
        fn destroy_stream(&self, s: BumpStream) -> Result<(), BackendError> {
            let mut a = lock(&self.arena);
            self.check_stream(&a, &s, "destroy_stream")?;
            a.streams.retain(|&x| x != s.id);
            Ok(())
        }
        fn allocate(&self, s: &BumpStream, bytes: u64) -> Result<BumpMemory, BackendError> {
            let mut a = lock(&self.arena);
            self.check_stream(&a, s, "allocate")?;
            let total = a.bytes.len() as u64;
            if bytes == 0 || bytes > total - a.top {
                return Err(err(
                    "allocate",
                    BackendErrorKind::OutOfMemory,
                    format!("asked {bytes} B, {} B free", total - a.top),
                ));
            }
            let offset = a.top;
            a.top += bytes;
            a.live.push((offset, bytes));
            Ok(BumpMemory {
                ctx: self.id,
                offset,
                len: bytes,
            })
        }
        fn free_async(
            &self,
            s: &BumpStream,
            m: BumpMemory,
            retired: RetireSignal,
        ) -> Result<(), (BumpMemory, RetireSignal, BackendError)> {
            {
                let mut a = lock(&self.arena);
                if let Err(e) = self
                    .check_stream(&a, s, "free_async")
                    .and_then(|_| self.check_range(&a, &m, 0, 0, "free_async"))
                {
                    return Err((m, retired, e));
                }
                a.live.retain(|&b| b != (m.offset, m.len));
                if a.live.is_empty() {
                    a.top = 0; // a bump arena reclaims when it empties
                }
            }
            retired.retire(); // no lock held while calling out
            Ok(())
        }
        fn write(
            &self,
            s: &BumpStream,
            m: &BumpMemory,
            off: u64,
            src: &[u8],
        ) -> Result<(), BackendError> {
            let mut a = lock(&self.arena);
            self.check_stream(&a, s, "write")?;
            self.check_range(&a, m, off, src.len(), "write")?;
            let at = (m.offset + off) as usize;
            a.bytes[at..at + src.len()].copy_from_slice(src);
            Ok(())
        }
        fn read(
            &self,
            s: &BumpStream,
            m: &BumpMemory,
            off: u64,
            dst: &mut [u8],
        ) -> Result<(), BackendError> {
            let a = lock(&self.arena);
            self.check_stream(&a, s, "read")?;
            self.check_range(&a, m, off, dst.len(), "read")?;
            let at = (m.offset + off) as usize;
            dst.copy_from_slice(&a.bytes[at..at + dst.len()]);
            Ok(())
        }
        fn synchronize(&self, s: &BumpStream) -> Result<(), BackendError> {
            self.check_stream(&lock(&self.arena), s, "synchronize")
        }
        fn order_after(&self, s: &BumpStream, after: &BumpStream) -> Result<(), BackendError> {
            let a = lock(&self.arena);
            self.check_stream(&a, s, "order_after")?;
            self.check_stream(&a, after, "order_after") // synchronous: already ordered
        }
        fn teardown(self, _lost: bool) -> Result<(), BackendError> {
            // Teardown also releases what a force-retired or lost context abandoned.
            let mut a = lock(&self.arena);
            a.live.clear();
            a.streams.clear();
            a.top = 0;
            Ok(())
        }
    }
}
use arena::BumpContext;

memgov_conformance::conformance_tests!(bump, || BumpContext::new(64 << 20));

#[test]
fn suite_report() {
    let report = memgov_conformance::run_suite(|| BumpContext::new(64 << 20));
    println!("{report}");
    assert!(report.all_passed(), "{report}");
}

/// A fault-matrix factory: a fresh bump context and its leak check.
fn with_leak_check() -> Option<(BumpContext, memgov_conformance::LeakCheck)> {
    let c = BumpContext::new(64 << 20).ok()?;
    let leak: memgov_conformance::LeakCheck = Box::new(c.leak_check());
    Some((c, leak))
}

/// Every cell survives, and the matrix of a device-only backend has no
/// `[pinned-host]` rows (fewer cells than a backend with the tier).
#[test]
fn fault_matrix_without_pinned_rows() {
    let m = memgov_conformance::fault_matrix("bump", with_leak_check)
        .expect("bump is always available");
    println!("{m}");
    assert!(m.all_survived(), "{m}");
    assert!(!m.pinned_host_tier);
    assert!(m
        .cells
        .iter()
        .all(|c| !c.operation.contains("[pinned-host]")));
    assert!(m.expected_cells_here() < memgov_conformance::FaultMatrix::expected_cells());
    assert_eq!(m.cells.len(), m.expected_cells_here());
}

#[test]
fn the_cached_suite_and_matrix_run_through_the_kit_alone() {
    let cached = memgov_conformance::SuiteOptions::new()
        .cache(memgov_conformance::CacheConfig::new(8 << 20));
    let report = memgov_conformance::run_suite_with(&cached, || BumpContext::new(64 << 20));
    assert!(report.all_passed(), "{report}");
    let m = memgov_conformance::fault_matrix_with("bump", &cached, with_leak_check)
        .expect("bump is always available");
    assert!(m.all_survived(), "{m}");
}
