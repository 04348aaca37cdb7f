//! Integration tests of shoal-comm: one conformance suite run over every
//! transport, and the fault tests (wrong secret, garbage on the wire, dead peers).

mod conformance;
mod faults;
