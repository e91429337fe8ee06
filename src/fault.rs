//! Fault injection over any backend (being written; see issue #4).
