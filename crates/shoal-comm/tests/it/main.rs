//! Integration tests of shoal-comm: one conformance suite run over every
//! transport, the fault tests (wrong secret, garbage on the wire, dead peers), and the arrival skew.

mod arrival;
mod compress;
mod conformance;
mod faults;
