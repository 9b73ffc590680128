//! Shared-memory rows: a client maps its logits into a file on a
//! memory filesystem (`/dev/shm`, a `medium: Memory` emptyDir in a pod),
//! registers it once (`RegisterSharedMemory`), and then names rows in it
//! (`SharedLogits`: region, offset, count, dtype) instead of sending them.
//! The server reads each row in place, in the one fused pass that loads
//! it into the step's buffer — no socket copy, no receive buffer, no
//! decode — which is what bounds inline rows (docs/PERFORMANCE.md).
//!
//! This module keeps the registry: who owns which region
//! (`transport::identity`: a bearer token, a Unix peer's uid, or a TCP
//! peer's address), the limits (`limits.max_shared_regions`,
//! `limits.max_shared_bytes`, shown in /metrics), the release when the
//! registering connection closes (`transport.release_shared_on_disconnect`)
//! and the check of every row against its region's bounds. [`open`] says
//! which files may be registered; [`mapping`] how a mapping survives a
//! client that truncates its file.

pub mod mapping;
pub mod open;
pub mod verify_rows;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use samplerd_api::v1;

use crate::request::convert::FIELD_SHARED;
use crate::request::errors::RequestError;
use crate::service::validate::row_logits::{Dtype, RowLogits};
use crate::status::Reason;
use crate::transport::connections::ConnInfo;
use crate::transport::identity::Caller;
use mapping::SharedMapping;

/// Gauge: shared-memory regions registered.
pub const REGIONS_METRIC: &str = "samplerd_shared_memory_regions";
/// Gauge: bytes of shared memory registered.
pub const BYTES_METRIC: &str = "samplerd_shared_memory_bytes";
/// Longest region name.
pub const MAX_NAME_BYTES: usize = 128;

/// Describes the gauges for /metrics.
pub fn describe_metrics() {
    metrics::describe_gauge!(REGIONS_METRIC, "Shared-memory regions registered");
    metrics::describe_gauge!(
        BYTES_METRIC,
        metrics::Unit::Bytes,
        "Bytes of shared memory registered"
    );
}

/// The registry's settings (from `[transport]` and `[limits]`).
#[derive(Clone, Debug)]
pub struct SharedMemoryConfig {
    pub dirs: Vec<PathBuf>,
    pub release_on_disconnect: bool,
    pub max_regions: usize,
    pub max_bytes: u64,
}

impl SharedMemoryConfig {
    /// From `[transport]` and `[limits]`.
    pub fn new(
        transport: &crate::transport::listen::TransportConfig,
        limits: &crate::service::limits::LimitsConfig,
    ) -> Self {
        SharedMemoryConfig {
            dirs: transport.shared_memory_dirs.clone(),
            release_on_disconnect: transport.release_shared_on_disconnect,
            max_regions: limits.max_shared_regions,
            max_bytes: limits.max_shared_bytes,
        }
    }
}

/// A registered region.
#[derive(Debug)]
pub struct Region {
    pub name: String,
    owner: Caller,
    /// The connection that registered it.
    conn: Option<u64>,
    map: SharedMapping,
}

/// The registered regions.
#[derive(Debug)]
pub struct SharedRegions {
    config: SharedMemoryConfig,
    dirs: Vec<PathBuf>,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_name: HashMap<String, Arc<Region>>,
    bytes: u64,
    /// Connections whose close releases their regions (hook installed).
    hooked: HashSet<u64>,
}

/// A row in a region, checked against its bounds; holds the region mapped.
#[derive(Debug)]
pub struct SharedRow {
    region: Arc<Region>,
    offset: usize,
    count: usize,
    dtype: Dtype,
}

fn check_name(name: &str, field: &str) -> Result<(), RequestError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        return Ok(());
    }
    let shown: String = name.chars().take(MAX_NAME_BYTES).collect();
    Err(RequestError::invalid(
        field,
        format!("{shown:?}: a region name is 1 to {MAX_NAME_BYTES} bytes of [A-Za-z0-9._-]"),
    ))
}

/// The server's effective user id (the owner a file must have when the
/// caller's own is unknown).
fn server_uid() -> u32 {
    use std::os::unix::fs::MetadataExt as _;
    // /proc/self belongs to the process' effective user.
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}

impl SharedRegions {
    pub fn new(config: SharedMemoryConfig) -> Arc<Self> {
        Arc::new(SharedRegions {
            dirs: open::canonical_dirs(&config.dirs),
            config,
            inner: Mutex::new(Inner::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn publish(inner: &Inner) {
        metrics::gauge!(REGIONS_METRIC).set(inner.by_name.len() as f64);
        metrics::gauge!(BYTES_METRIC).set(inner.bytes as f64);
    }

    /// `RegisterSharedMemory` for `caller` (whose Unix peer uid, if any, is
    /// `peer_uid`) on connection `conn`.
    pub fn register(
        self: &Arc<Self>,
        req: &v1::RegisterSharedMemoryRequest,
        caller: Caller,
        peer_uid: Option<u32>,
        conn: Option<&ConnInfo>,
    ) -> Result<(), RequestError> {
        check_name(&req.name, "name")?;
        let owner_uid = peer_uid.unwrap_or_else(server_uid);
        let byte_size = req.byte_size;
        {
            let inner = self.lock();
            self.admit(&inner, &req.name, &caller, byte_size)?;
        }
        let file = open::open(&req.path, byte_size, &self.dirs, owner_uid)?;
        let len = usize::try_from(byte_size).map_err(|_| {
            RequestError::invalid(open::FIELD_BYTE_SIZE, format!("{byte_size} is too large"))
        })?;
        let map = SharedMapping::map(&file, len).map_err(|e| match e {
            mapping::MapError::Full(_) => RequestError::exhausted(
                Reason::SharedMemoryFull,
                "limits.max_shared_regions",
                e.to_string(),
            ),
            mapping::MapError::Io(e) => RequestError::invalid(
                open::FIELD_PATH,
                format!("cannot map {byte_size} bytes: {e}"),
            ),
        })?;
        let release = self.config.release_on_disconnect;
        let mut inner = self.lock();
        // Checked again: another registration may have come in meanwhile.
        self.admit(&inner, &req.name, &caller, byte_size)?;
        inner.bytes += byte_size;
        inner.by_name.insert(
            req.name.clone(),
            Arc::new(Region {
                name: req.name.clone(),
                owner: caller,
                conn: conn.filter(|_| release).map(|c| c.id),
                map,
            }),
        );
        Self::publish(&inner);
        if release
            && let Some(conn) = conn
            && inner.hooked.insert(conn.id)
        {
            let weak: Weak<Self> = Arc::downgrade(self);
            let id = conn.id;
            conn.on_close(move || {
                if let Some(regions) = weak.upgrade() {
                    regions.release_connection(id);
                }
            });
        }
        tracing::debug!(name = %req.name, path = %req.path, byte_size, %caller, "shared memory registered");
        Ok(())
    }

    /// Whether `caller` may add region `name` of `byte_size` bytes now.
    fn admit(
        &self,
        inner: &Inner,
        name: &str,
        caller: &Caller,
        byte_size: u64,
    ) -> Result<(), RequestError> {
        if let Some(r) = inner.by_name.get(name) {
            let whose = if r.owner == *caller {
                "by this caller"
            } else {
                "by another identity"
            };
            return Err(RequestError::refused(
                Reason::RegionExists,
                "name",
                format!("{name:?} is already registered {whose}"),
            ));
        }
        let c = &self.config;
        if inner.by_name.len() >= c.max_regions {
            return Err(RequestError::exhausted(
                Reason::SharedMemoryFull,
                "limits.max_shared_regions",
                format!(
                    "{} shared-memory regions are registered: limits.max_shared_regions = {}",
                    inner.by_name.len(),
                    c.max_regions
                ),
            ));
        }
        if inner.bytes.saturating_add(byte_size) > c.max_bytes {
            return Err(RequestError::exhausted(
                Reason::SharedMemoryFull,
                "limits.max_shared_bytes",
                format!(
                    "byte_size {byte_size} over the {} bytes registered exceeds limits.max_shared_bytes = {}",
                    inner.bytes, c.max_bytes
                ),
            ));
        }
        Ok(())
    }

    /// `UnregisterSharedMemory`.
    pub fn unregister(&self, name: &str, caller: &Caller) -> Result<(), RequestError> {
        check_name(name, "name")?;
        let mut inner = self.lock();
        let region = Self::owned(&inner, name, caller, "name")?;
        Self::remove(&mut inner, &region);
        Ok(())
    }

    /// The region `name` if `caller` owns it.
    fn owned(
        inner: &Inner,
        name: &str,
        caller: &Caller,
        field: &str,
    ) -> Result<Arc<Region>, RequestError> {
        let Some(r) = inner.by_name.get(name) else {
            return Err(RequestError::refused(
                Reason::UnknownRegion,
                field,
                format!("no shared-memory region {name:?} is registered"),
            ));
        };
        if r.owner != *caller {
            return Err(RequestError::refused(
                Reason::SharedMemoryDenied,
                field,
                format!("region {name:?} belongs to another identity than {caller}"),
            ));
        }
        Ok(Arc::clone(r))
    }

    /// Drops `region` from the registry if it is still the one under its
    /// name (it is unmapped once no request holds it).
    fn remove(inner: &mut Inner, region: &Arc<Region>) {
        if inner
            .by_name
            .get(&region.name)
            .is_some_and(|r| Arc::ptr_eq(r, region))
        {
            inner.by_name.remove(&region.name);
            inner.bytes -= region.map.bytes().len() as u64;
            Self::publish(inner);
        }
    }

    /// Releases the regions connection `conn` registered.
    pub fn release_connection(&self, conn: u64) {
        let mut inner = self.lock();
        inner.hooked.remove(&conn);
        let gone: Vec<Arc<Region>> = inner
            .by_name
            .values()
            .filter(|r| r.conn == Some(conn))
            .cloned()
            .collect();
        for r in &gone {
            Self::remove(&mut inner, r);
        }
        if !gone.is_empty() {
            tracing::debug!(
                conn,
                regions = gone.len(),
                "connection closed: its shared memory released"
            );
        }
    }

    /// Releases every region (at shutdown).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.by_name.clear();
        inner.bytes = 0;
        Self::publish(&inner);
    }

    /// Number of regions registered.
    pub fn len(&self) -> usize {
        self.lock().by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row `msg` names, for `caller`, checked against its region:
    /// inside it, aligned to its dtype, at most `max_vocab` logits. Errors
    /// name `shared.region`, `shared.offset`, `shared.count` or
    /// `shared.dtype`.
    pub fn resolve(
        &self,
        msg: &v1::SharedLogits,
        caller: &Caller,
        max_vocab: usize,
    ) -> Result<SharedRow, RequestError> {
        let dtype = Dtype::from_proto(msg.dtype).map_err(|_| {
            RequestError::invalid(
                "shared.dtype",
                format!("unknown LogitsDtype {} (F32LE, F16LE or BF16LE)", msg.dtype),
            )
        })?;
        let region = {
            let inner = self.lock();
            Self::owned(&inner, &msg.region, caller, "shared.region")?
        };
        let count = msg.count as usize;
        if count == 0 {
            return Err(RequestError::invalid(
                "shared.count",
                "is 0: a row has at least one logit",
            ));
        }
        if count > max_vocab {
            return Err(RequestError::limit(
                "shared.count",
                "limits.max_vocab",
                format!("{count} logits exceed the limit of {max_vocab} (limits.max_vocab)"),
            ));
        }
        let width = dtype.width() as u64;
        if !msg.offset.is_multiple_of(width) {
            return Err(RequestError::invalid(
                "shared.offset",
                format!(
                    "{} is not a multiple of {width} (the dtype's width): rows must be aligned",
                    msg.offset
                ),
            ));
        }
        let size = region.map.bytes().len() as u64;
        let end = msg.offset.checked_add(count as u64 * width);
        if end.is_none_or(|e| e > size) {
            return Err(RequestError::invalid(
                "shared.offset",
                format!(
                    "offset {} + count {count} × {width} bytes runs past the end of region {:?} ({size} bytes)",
                    msg.offset, region.name
                ),
            ));
        }
        Ok(SharedRow {
            offset: msg.offset as usize,
            count,
            dtype,
            region,
        })
    }

    /// A message's `shared` row, when set: `others` are the message's
    /// other encodings (whether set, and their names), none of which may
    /// be set with it.
    pub fn resolve_in(
        &self,
        msg: Option<&v1::SharedLogits>,
        others: &[(bool, &str)],
        caller: &Caller,
        max_vocab: usize,
    ) -> Result<Option<SharedRow>, RequestError> {
        let Some(msg) = msg else {
            return Ok(None);
        };
        if let Some((_, other)) = others.iter().find(|(set, _)| *set) {
            let names: Vec<String> = others.iter().map(|(_, n)| format!("`{n}`")).collect();
            return Err(RequestError::invalid(
                FIELD_SHARED,
                format!(
                    "set exactly one of {} and `shared`, got `shared` and `{other}`",
                    names.join(", ")
                ),
            ));
        }
        self.resolve(msg, caller, max_vocab).map(Some)
    }

    /// After the row was read: an error naming the region if a truncation
    /// zeroed it meanwhile (the region is then unregistered).
    pub fn check_read(&self, row: &SharedRow) -> Result<(), RequestError> {
        if !row.region.map.poisoned() {
            return Ok(());
        }
        Self::remove(&mut self.lock(), &row.region);
        tracing::warn!(region = %row.region.name, "shared-memory region truncated while read: unregistered");
        Err(RequestError::refused(
            Reason::RegionLost,
            "shared.region",
            format!(
                "region {:?} was truncated by its owner while it was read: it is unregistered \
                 (register it again)",
                row.region.name
            ),
        ))
    }
}

impl SharedRow {
    /// The row's bytes in the mapping.
    pub fn bytes(&self) -> &[u8] {
        let w = self.dtype.width();
        &self.region.map.bytes()[self.offset..self.offset + self.count * w]
    }

    /// The row as a step's logits: f32 read in place, f16/bf16 widened.
    pub fn logits(&self) -> RowLogits<'_> {
        let inner = match self.dtype {
            Dtype::F32le => RowLogits::F32le(self.bytes()),
            // Within max_vocab and a whole number of logits: cannot fail.
            d => RowLogits::decode(d, self.bytes(), None, usize::MAX)
                .unwrap_or(RowLogits::Widened(Vec::new())),
        };
        RowLogits::Shared(Box::new(inner))
    }

    /// Number of logits.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}
