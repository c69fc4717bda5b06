//! placeholder
pub mod region;
pub use region::RegionKind;
