//! Backends and external implementations as worker processes (`docs/worker-protocol.md`):
//! the protocol's messages and files, the server that serves an in-tree backend, the client
//! of one worker process, and the pool the campaign runs cases on.

pub mod client;
pub mod io;
pub mod pool;
pub mod protocol;
pub mod serve;

pub use pool::{Pool, PoolConfig, SpawnFor};
