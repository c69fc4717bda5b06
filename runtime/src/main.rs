//! The `dynamo-node` daemon. Everything lives in the library; see `dynamo_node::cli`.

fn main() -> std::process::ExitCode {
    dynamo_node::cli::main()
}
