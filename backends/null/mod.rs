//! The null backend (being written; see issue #5).
