//! What the CUDA test files that run their cases in child processes on the
//! stand-in share: the part every vendor shares (`backends/cases/common.rs`:
//! whether the stand-in is loaded, children that must pass or must be
//! stopped by the stand-in, the stand-in's hooks, the conformance fault
//! cells, arena fault cases and stress), instantiated for CUDA through the
//! `vendor` module (`common_table!`, from CUDA's table, `table.rs`).

#![allow(dead_code)]

#[macro_use]
pub mod table;

common_table!();
