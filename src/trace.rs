//! A memory timeline: what the governor did, when, per context, stream and
//! role, written in the Chrome trace event format that Perfetto
//! (`ui.perfetto.dev`) and `chrome://tracing` open, and that `memgov report`
//! turns into a self-contained HTML page.
//!
//! A [`Trace`] is given to the contexts it should record
//! ([`ContextConfig::trace`](crate::ContextConfig::trace)); every context
//! given the same `Trace` records into it, so one file shows a device swap
//! or several models side by side. Recording takes a lock per event, so it
//! is off unless asked for: a context without a trace pays one branch per
//! allocation and release.
//!
//! ```
//! use memgov::host::{HostConfig, HostContext};
//! use memgov::trace::Trace;
//! use memgov::{Alloc, ContextConfig, Governor, Role};
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let trace = Trace::new();
//! let gov: Governor<HostContext> = Governor::new();
//! let ctx = gov.register(
//!     HostContext::new(HostConfig::default())?,
//!     ContextConfig::new().label("model-a").budget(1 << 20).trace(&trace),
//! );
//! let stream = ctx.create_stream("main")?;
//! drop(ctx.allocate(&stream, Alloc::new(4096, Role::Activation))?);
//! drop(stream);
//! ctx.retire().wait_timeout(Duration::from_secs(5))?;
//!
//! let kinds: Vec<_> = trace.events().iter().map(|e| e.kind).collect();
//! assert!(kinds.contains(&memgov::trace::EventKind::Allocated));
//! let json = trace.to_chrome_json(); // write it to a file, open it in Perfetto
//! assert!(json.starts_with("{\"traceEvents\":["));
//! # Ok(())
//! # }
//! ```

use crate::sync::lock;
use crate::Role;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A context was registered.
    Registered,
    /// A stream was created.
    StreamCreated,
    /// An allocation was admitted with a backend allocation: `bytes`
    /// became live. Recorded once per buffer, however it was made
    /// (`ContextHandle::allocate`, in any tier, or `Reservation::allocate`),
    /// except one served from the block cache, which is
    /// [`Reused`](Self::Reused); one made out of a reservation carries the
    /// reservation's label as its note, and its bytes leave the
    /// reservation's [`Reserved`](Self::Reserved) bytes.
    Allocated,
    /// A buffer was released with a stream-ordered free: `bytes` went from
    /// live to pending. Recorded once per buffer not kept by the block
    /// cache (that one is [`Cached`](Self::Cached)); one whose free will
    /// never retire (refused, on a lost device, reclaimed by force) is
    /// followed by [`Abandoned`](Self::Abandoned).
    Released,
    /// A released buffer was kept by the block cache
    /// ([`ContextConfig::cache`](crate::ContextConfig::cache)) instead of
    /// being freed: `bytes` (its size class) went from live to cached.
    /// They stay charged to the context and its budgets; nothing was
    /// freed. Carries the buffer's site, like [`Released`](Self::Released).
    Cached,
    /// An allocation was served from the block cache: `bytes` went from
    /// cached to live, with no backend allocation. Its role is the
    /// allocation's (the block may have been cached as another's). Carries
    /// the allocation's site, like [`Allocated`](Self::Allocated).
    Reused,
    /// A pending release's free executed on the device: `bytes` are back.
    Retired,
    /// A pending release will never execute (device lost, or the free was
    /// refused after it was accepted): its bytes stay charged until teardown.
    Abandoned,
    /// A live buffer released on another stream than its own left its own
    /// stream's track (followed by [`MovedIn`](Self::MovedIn)).
    MovedOut,
    /// ... and joined the stream it is released on.
    MovedIn,
    /// An allocation was refused: `bytes` is what was asked.
    Refused,
    /// Pressure responders were asked to free `bytes`.
    Pressure,
    /// A reservation was made or grown (`ContextHandle::reserve`,
    /// `Reservation::grow`): `bytes` are charged to the budgets without
    /// being live. The note is the reservation's label.
    Reserved,
    /// Unused bytes of a reservation went back to the budgets: given back
    /// (`Reservation::shrink`) or the remainder at its drop. The note is the
    /// reservation's label.
    Unreserved,
    /// The live device-tier bytes of `role` were put to sleep
    /// (`ContextHandle::sleep_with`): taken off the budgets, still live.
    /// One event per role that had bytes.
    Slept,
    /// The sleeping bytes of `role` woke (`ContextHandle::wake_with`):
    /// charged again. One event per role that had bytes.
    Woke,
    /// Cached bytes given back, or a trim of the process budget. Two shapes:
    ///
    /// * With a stream and a role: one block of the block cache given back
    ///   to the backend with a stream-ordered free: `bytes` went from
    ///   cached to pending ([`Retired`](Self::Retired) or
    ///   [`Abandoned`](Self::Abandoned) follows, as after
    ///   [`Released`](Self::Released)). The note says which path gave it
    ///   back: `trim_cache` (`ContextHandle::trim_cache`), `pressure` (a
    ///   refused admission, a shared budget's member asked for room, or a
    ///   process-budget trim), `evicted for a newer block` (the cache at
    ///   its limit), `retire`, `the device is lost`, `stream dropped` or
    ///   `flushed` (the bins closed as the block arrived).
    /// * With neither: a trim of the process budget (`ProcessBudget::trim`,
    ///   which the machine ledger calls when another process on the device
    ///   asks for room) asked this context's block cache and pressure
    ///   responders: `bytes` is what they gave back, the cache's blocks
    ///   among them (each also recorded as its own event of the first
    ///   shape, just before). The note says what the process was asked for.
    ///
    /// So the cached bytes of a context at any point of its timeline are
    /// [`Cached`](Self::Cached) − [`Reused`](Self::Reused) − the
    /// role-bearing `Trimmed`, which is what its snapshot's
    /// [`CacheUsage::cached_bytes`](crate::CacheUsage::cached_bytes) reads.
    Trimmed,
    /// The context began retiring.
    RetireBegun,
    /// The backend's teardown ran.
    TornDown,
}

impl EventKind {
    /// The name written to the trace.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Registered => "registered",
            Self::StreamCreated => "stream created",
            Self::Allocated => "allocated",
            Self::Released => "released",
            Self::Cached => "cached",
            Self::Reused => "reused",
            Self::Retired => "retired",
            Self::Abandoned => "abandoned",
            Self::MovedOut => "moved out",
            Self::MovedIn => "moved in",
            Self::Refused => "refused",
            Self::Pressure => "pressure",
            Self::Reserved => "reserved",
            Self::Unreserved => "unreserved",
            Self::Slept => "slept",
            Self::Woke => "woke",
            Self::Trimmed => "trimmed",
            Self::RetireBegun => "retire begun",
            Self::TornDown => "torn down",
        }
    }
}

/// One recorded event.
#[derive(Debug, Clone)]
pub struct Event {
    /// Time since the trace was created.
    pub at: Duration,
    /// The context's label (its identity when it has none).
    pub context: Arc<str>,
    /// The stream's label, for events that belong to one.
    pub stream: Option<Arc<str>>,
    /// The memory role, for events about bytes of one role.
    pub role: Option<Role>,
    /// What happened.
    pub kind: EventKind,
    /// How many bytes it concerned (0 when none).
    pub bytes: u64,
    /// A short explanation (a refusal's message), when there is one.
    pub note: Option<String>,
    /// The call site of the allocation the event is about (`file:line:col`,
    /// or the name given with [`Alloc::site`](crate::Alloc::site)), on a
    /// context with attribution on
    /// ([`ContextConfig::attribution`](crate::ContextConfig::attribution)):
    /// set on [`Allocated`](EventKind::Allocated),
    /// [`Released`](EventKind::Released), [`Cached`](EventKind::Cached),
    /// [`Reused`](EventKind::Reused) and [`Refused`](EventKind::Refused)
    /// events of allocations, the site their
    /// [`ContextSnapshot::sites`](crate::ContextSnapshot::sites) row names.
    pub site: Option<Arc<str>>,
    /// The label the allocation was given with
    /// [`Alloc::label`](crate::Alloc::label), beside its [`site`](Self::site).
    pub label: Option<Arc<str>>,
}

/// Where an event's allocation was made, on a context with attribution on:
/// its site and label, as its snapshot's row names them.
#[derive(Debug, Clone, Default)]
pub(crate) struct SiteNames {
    pub site: Option<Arc<str>>,
    pub label: Option<Arc<str>>,
}

/// A recorder shared by the contexts it traces. Cloning it is cheap and
/// every clone records into the same timeline.
#[derive(Clone, Debug)]
pub struct Trace {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    start: Instant,
    limit: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    events: Vec<Event>,
    dropped: u64,
}

impl Default for Trace {
    fn default() -> Self {
        Self::new()
    }
}

impl Trace {
    /// A trace that keeps up to 1,000,000 events (then counts what it drops).
    pub fn new() -> Self {
        Self::with_limit(1_000_000)
    }

    /// A trace that keeps at most `limit` events; later ones are counted in
    /// [`dropped`](Self::dropped) and the written file says so.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                start: Instant::now(),
                limit,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Records one event.
    pub fn record(
        &self,
        context: &Arc<str>,
        stream: Option<&Arc<str>>,
        role: Option<Role>,
        kind: EventKind,
        bytes: u64,
        note: Option<String>,
    ) {
        self.push(Event {
            at: self.inner.start.elapsed(),
            context: context.clone(),
            stream: stream.cloned(),
            role,
            kind,
            bytes,
            note,
            site: None,
            label: None,
        });
    }

    /// Time since the trace was created: what an event recorded now
    /// carries as [`Event::at`] (for lining up something taken outside the
    /// trace, such as a snapshot, with its events).
    pub fn elapsed(&self) -> Duration {
        self.inner.start.elapsed()
    }

    fn push(&self, event: Event) {
        let mut state = lock(&self.inner.state);
        if state.events.len() < self.inner.limit {
            state.events.push(event);
        } else {
            state.dropped += 1;
        }
    }

    /// Every event kept so far, in the order recorded.
    pub fn events(&self) -> Vec<Event> {
        lock(&self.inner.state).events.clone()
    }

    /// Events recorded past the limit and not kept.
    pub fn dropped(&self) -> u64 {
        lock(&self.inner.state).dropped
    }

    /// The timeline in the Chrome trace event format (JSON): one process per
    /// context, one thread per stream; counter tracks of live and pending
    /// bytes per role and of cached bytes (kept by the block cache, one
    /// figure: a block may be reused by another role) for each stream and
    /// for each context; instant events
    /// for refusals, pressure, reservations, sleeps and wakes, retire and
    /// teardown; the memgov events themselves under `memgovEvents` (`t_us`,
    /// `context`, `stream`, `role`, `kind`, `bytes`, and `note`, `site` and
    /// `label` when the event has them).
    pub fn to_chrome_json(&self) -> String {
        let (events, dropped) = {
            let state = lock(&self.inner.state);
            (state.events.clone(), state.dropped)
        };
        chrome_json(&events, dropped)
    }

    /// Writes [`to_chrome_json`](Self::to_chrome_json) to `path`.
    pub fn write_chrome_json(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        std::fs::write(path, self.to_chrome_json())
    }
}

/// A context's view of its trace: the context's name, and its streams'
/// names by the tag each stream was given at creation (0: no stream).
#[derive(Debug)]
pub(crate) struct ContextTrace {
    trace: Trace,
    context: Arc<str>,
    streams: Mutex<Vec<Arc<str>>>,
    /// The names of the context's sites seen so far, by their id in its
    /// table of sites.
    sites: Mutex<std::collections::HashMap<u32, SiteNames>>,
}

impl ContextTrace {
    pub(crate) fn new(trace: Trace, context: String) -> Self {
        let this = Self {
            trace,
            context: Arc::from(context),
            streams: Mutex::new(Vec::new()),
            sites: Mutex::new(std::collections::HashMap::new()),
        };
        this.event(0, None, EventKind::Registered, 0, None);
        this
    }

    /// A stream named `label` was created: its tag (never 0).
    pub(crate) fn stream_created(&self, label: &str) -> u32 {
        let tag = {
            let mut streams = lock(&self.streams);
            streams.push(Arc::from(label));
            u32::try_from(streams.len()).unwrap_or(u32::MAX)
        };
        self.event(tag, None, EventKind::StreamCreated, 0, None);
        tag
    }

    /// Records one event of this context on the stream tagged `stream`.
    pub(crate) fn event(
        &self,
        stream: u32,
        role: Option<Role>,
        kind: EventKind,
        bytes: u64,
        note: Option<String>,
    ) {
        self.event_at(stream, role, kind, bytes, note, SiteNames::default());
    }

    /// [`event`](Self::event) of an allocation made at `site`.
    pub(crate) fn event_at(
        &self,
        stream: u32,
        role: Option<Role>,
        kind: EventKind,
        bytes: u64,
        note: Option<String>,
        site: SiteNames,
    ) {
        let label = match stream {
            0 => None,
            tag => lock(&self.streams).get(tag as usize - 1).cloned(),
        };
        self.trace.push(Event {
            at: self.trace.inner.start.elapsed(),
            context: self.context.clone(),
            stream: label,
            role,
            kind,
            bytes,
            note,
            site: site.site,
            label: site.label,
        });
    }

    /// The names of the site counted as `id` in the context's table,
    /// formatted once per site and shared by its events.
    pub(crate) fn site_names(
        &self,
        id: u32,
        name: impl FnOnce() -> Option<(String, Option<&'static str>)>,
    ) -> SiteNames {
        if id == 0 {
            return SiteNames::default();
        }
        let mut sites = lock(&self.sites);
        if let Some(known) = sites.get(&id) {
            return known.clone();
        }
        let Some((site, label)) = name() else {
            return SiteNames::default();
        };
        let names = SiteNames {
            site: Some(Arc::from(site)),
            label: label.map(Arc::from),
        };
        sites.insert(id, names.clone());
        names
    }
}

/// Running byte totals of one track, per role.
#[derive(Default, Clone, Copy)]
struct Totals {
    live: [u64; Role::ALL.len()],
    /// One figure, not per role: a block may be reused by another role
    /// than the one it was cached as.
    cached: u64,
    pending: [u64; Role::ALL.len()],
}

fn chrome_json(events: &[Event], dropped: u64) -> String {
    let mut out = String::with_capacity(64 + events.len() * 160);
    out.push_str("{\"traceEvents\":[");
    let mut first = true;
    let mut push = |out: &mut String, item: String| {
        if !std::mem::take(&mut first) {
            out.push(',');
        }
        out.push_str(&item);
    };
    // Contexts become processes, streams threads (tid 0: the context).
    let mut pids: BTreeMap<Arc<str>, usize> = BTreeMap::new();
    let mut tids: BTreeMap<(usize, Arc<str>), usize> = BTreeMap::new();
    let mut totals: BTreeMap<(usize, usize), Totals> = BTreeMap::new();
    for e in events {
        let next_pid = pids.len() + 1;
        let pid = *pids.entry(e.context.clone()).or_insert_with(|| {
            push(
                &mut out,
                format!(
                    "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{next_pid},\"tid\":0,\"args\":{{\"name\":{}}}}}",
                    json_str(&format!("context {}", e.context))
                ),
            );
            next_pid
        });
        let tid = match &e.stream {
            None => 0,
            Some(s) => {
                let next_tid = tids.keys().filter(|(p, _)| *p == pid).count() + 1;
                *tids.entry((pid, s.clone())).or_insert_with(|| {
                    push(
                        &mut out,
                        format!(
                            "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{next_tid},\"args\":{{\"name\":{}}}}}",
                            json_str(&format!("stream {s}"))
                        ),
                    );
                    next_tid
                })
            }
        };
        let ts = e.at.as_nanos() as f64 / 1000.0;
        // (role, live, cached, pending) deltas.
        let b = e.bytes as i128;
        let moved = match (e.kind, e.role) {
            (EventKind::Allocated | EventKind::MovedIn, Some(r)) => Some((r, b, 0, 0i128)),
            (EventKind::MovedOut, Some(r)) => Some((r, -b, 0, 0)),
            (EventKind::Released, Some(r)) => Some((r, -b, 0, b)),
            (EventKind::Cached, Some(r)) => Some((r, -b, b, 0)),
            (EventKind::Reused, Some(r)) => Some((r, b, -b, 0)),
            (EventKind::Trimmed, Some(r)) => Some((r, 0, -b, b)),
            (EventKind::Retired | EventKind::Abandoned, Some(r)) => Some((r, 0, 0, -b)),
            _ => None,
        };
        if let Some((role, live, cached, pending)) = moved {
            // The stream's track and the context's (tid 0) track.
            let tracks: &[usize] = if tid == 0 { &[0] } else { &[tid, 0] };
            for &t in tracks {
                let tot = totals.entry((pid, t)).or_default();
                let i = role.index();
                tot.live[i] = (tot.live[i] as i128 + live).max(0) as u64;
                tot.cached = (tot.cached as i128 + cached).max(0) as u64;
                tot.pending[i] = (tot.pending[i] as i128 + pending).max(0) as u64;
                let scope = if t == 0 { "context" } else { "stream" };
                let by_role = |values: [u64; Role::ALL.len()]| {
                    let mut args = String::new();
                    for r in Role::ALL {
                        if !args.is_empty() {
                            args.push(',');
                        }
                        let _ = write!(args, "{}:{}", json_str(r.name()), values[r.index()]);
                    }
                    args
                };
                let mut tracks = vec![("live", by_role(tot.live))];
                // The cached track only on a context that caches.
                if cached != 0 || tot.cached > 0 {
                    tracks.push(("cached", format!("\"bytes\":{}", tot.cached)));
                }
                tracks.push(("pending", by_role(tot.pending)));
                for (name, args) in tracks {
                    push(
                        &mut out,
                        format!(
                            "{{\"name\":\"{name} bytes ({scope})\",\"cat\":\"memgov\",\"ph\":\"C\",\"ts\":{ts:.3},\"pid\":{pid},\"tid\":{t},\"args\":{{{args}}}}}"
                        ),
                    );
                }
            }
        }
        let marked = matches!(
            e.kind,
            EventKind::Refused
                | EventKind::Pressure
                | EventKind::RetireBegun
                | EventKind::TornDown
                | EventKind::Abandoned
                | EventKind::Reserved
                | EventKind::Unreserved
                | EventKind::Slept
                | EventKind::Woke
                | EventKind::Trimmed
        );
        if marked {
            let mut args = format!("\"bytes\":{}", e.bytes);
            if let Some(role) = e.role {
                let _ = write!(args, ",\"role\":{}", json_str(role.name()));
            }
            if let Some(note) = &e.note {
                let _ = write!(args, ",\"note\":{}", json_str(note));
            }
            if let Some(site) = &e.site {
                let _ = write!(args, ",\"site\":{}", json_str(site));
            }
            push(
                &mut out,
                format!(
                    "{{\"name\":{},\"cat\":\"memgov\",\"ph\":\"i\",\"s\":\"p\",\"ts\":{ts:.3},\"pid\":{pid},\"tid\":{tid},\"args\":{{{args}}}}}",
                    json_str(e.kind.name())
                ),
            );
        }
    }
    out.push_str("],\"displayTimeUnit\":\"ms\",\"memgovEvents\":[");
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            "{{\"t_us\":{:.3},\"context\":{},\"stream\":{},\"role\":{},\"kind\":{},\"bytes\":{}}}",
            e.at.as_nanos() as f64 / 1000.0,
            json_str(&e.context),
            e.stream.as_deref().map_or("null".into(), json_str),
            e.role.map_or("null".into(), |r| json_str(r.name())),
            json_str(e.kind.name()),
            e.bytes
        );
        out.truncate(out.len() - 1);
        for (name, value) in [
            ("note", e.note.as_deref()),
            ("site", e.site.as_deref()),
            ("label", e.label.as_deref()),
        ] {
            if let Some(value) = value {
                let _ = write!(out, ",\"{name}\":{}", json_str(value));
            }
        }
        out.push('}');
    }
    let _ = write!(out, "],\"memgovDropped\":{dropped}}}");
    out
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Arc<str> {
        Arc::from("a \"quoted\" context")
    }

    #[test]
    fn counters_follow_live_and_pending_bytes() {
        let t = Trace::new();
        let c = ctx();
        let s: Arc<str> = Arc::from("s0");
        t.record(
            &c,
            Some(&s),
            Some(Role::Weights),
            EventKind::Allocated,
            100,
            None,
        );
        t.record(
            &c,
            Some(&s),
            Some(Role::Weights),
            EventKind::Released,
            100,
            None,
        );
        t.record(
            &c,
            Some(&s),
            Some(Role::Weights),
            EventKind::Retired,
            100,
            None,
        );
        let json = t.to_chrome_json();
        assert!(json.contains(r#""name":"process_name""#), "{json}");
        assert!(json.contains(r#"context a \"quoted\" context"#), "{json}");
        // live 100 after the allocation; pending 100 after the release; 0 after retirement.
        assert!(json.contains(r#""name":"live bytes (stream)""#), "{json}");
        assert!(json.contains(r#""weights":100"#), "{json}");
        let last_pending = json
            .rmatch_indices(r#""name":"pending bytes (context)""#)
            .next()
            .map(|(i, _)| &json[i..])
            .unwrap();
        assert!(last_pending.contains(r#""weights":0"#), "{last_pending}");
    }

    #[test]
    fn cached_bytes_have_a_counter_track_of_their_own() {
        let t = Trace::new();
        let c = ctx();
        let s: Arc<str> = Arc::from("s0");
        // A workspace block reused as an activation: the cached figure is
        // one, whatever role the block was cached as.
        let (w, a) = (Role::Workspace, Role::Activation);
        for (role, kind) in [
            (w, EventKind::Allocated),
            (w, EventKind::Cached),
            (a, EventKind::Reused),
            (a, EventKind::Cached),
            (a, EventKind::Trimmed),
            (a, EventKind::Retired),
        ] {
            t.record(&c, Some(&s), Some(role), kind, 512, None);
        }
        let json = t.to_chrome_json();
        // The context's cached track after each event that moved it: in,
        // out (reused), in, out (trimmed); live 0 once the block is cached.
        let cached: Vec<&str> = json
            .match_indices(r#""name":"cached bytes (context)""#)
            .map(|(i, _)| {
                let rest = &json[i..];
                let at = rest.find(r#""bytes":"#).unwrap() + 8;
                let end = rest[at..].find(|ch: char| !ch.is_ascii_digit()).unwrap();
                &rest[at..at + end]
            })
            .collect();
        assert_eq!(cached, ["512", "0", "512", "0"], "{json}");
        // A context that never cached has no cached track.
        let plain = Trace::new();
        plain.record(&c, Some(&s), Some(w), EventKind::Allocated, 512, None);
        assert!(!plain.to_chrome_json().contains("cached bytes"));
    }

    #[test]
    fn a_full_trace_counts_what_it_drops() {
        let t = Trace::with_limit(2);
        let c = ctx();
        for _ in 0..5 {
            t.record(&c, None, None, EventKind::Pressure, 1, None);
        }
        assert_eq!((t.events().len(), t.dropped()), (2, 3));
        assert!(t.to_chrome_json().ends_with(r#""memgovDropped":3}"#));
    }

    #[test]
    fn strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\u0001""#);
    }
}
