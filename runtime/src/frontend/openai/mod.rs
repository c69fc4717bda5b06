//! The OpenAI APIs: Chat Completions and Completions ([`chat`]), Responses ([`responses`], with
//! its [`store`]), and their request bodies ([`wire`]).

pub(crate) mod chat;
pub(crate) mod responses;
pub(crate) mod store;
pub mod wire;
