//! How the command line parses: the positional form, the subcommand form with `--gpus LIST`,
//! `--gpus` alone (the GPU report), and bad GPU lists, each refused with a clear message.
use clap::Parser;

use crate::positional::Run;
use crate::{Cli, Command};

fn parse(args: &[&str]) -> Result<Cli, String> {
    Cli::try_parse_from(std::iter::once("fabric-debug").chain(args.iter().copied())).map_err(|e| e.to_string())
}

fn positional(args: &[&str]) -> Result<Option<Run>, String> {
    parse(args)?.positional.run().map_err(|e| e.0)
}

#[test]
fn gpus_and_nics_alone_run_a_server() {
    let Some(Run::Server(server)) = positional(&["0,1", "2"]).unwrap() else { panic!("not a server") };
    assert_eq!(server.gpus.unwrap().0, vec![0, 1]);
    assert_eq!(server.engine.domain_count, Some(2));
    assert_eq!(server.serve.listen, None, "the positional server picks 0.0.0.0:18515 itself");
    let Some(Run::Server(server)) = positional(&["0", "1", "--listen", "127.0.0.1:0", "--provider", "tcp"]).unwrap()
    else {
        panic!("not a server")
    };
    assert_eq!(server.gpus.unwrap().0, vec![0]);
    assert_eq!(server.serve.listen.as_deref(), Some("127.0.0.1:0"));
    assert_eq!(server.engine.provider.as_deref(), Some("tcp"));
}

#[test]
fn a_server_address_makes_it_the_client() {
    let argv = ["1,0", "2", "host-a:18515", "--json", "--force-network", "--sizes", "4K", "--tests", "rtt"];
    let Some(Run::Client(client)) = positional(&argv).unwrap() else { panic!("not a client") };
    assert_eq!(client.gpus.unwrap().0, vec![1, 0]);
    assert_eq!(client.connect, "host-a:18515");
    assert_eq!(client.engine.domain_count, Some(2));
    assert!(client.engine.force_network && client.tests.json);
    assert_eq!(client.tests.sizes, vec![4096]);
}

#[test]
fn the_subcommand_form_takes_a_gpu_list() {
    let cli = parse(&["server", "--gpus", "0,1", "--provider", "shm", "--force-network"]).unwrap();
    assert!(positional_is_empty(&cli));
    let Some(Command::Server(server)) = cli.command else { panic!("not the server command") };
    assert_eq!(server.gpus.unwrap().0, vec![0, 1]);
    assert!(server.engine.force_network);
    let cli = parse(&["client", "--gpus", "0", "--connect", "h:1"]).unwrap();
    let Some(Command::Client(client)) = cli.command else { panic!("not the client command") };
    assert_eq!(client.gpus.unwrap().0, vec![0]);
    let cli = parse(&["client", "--connect", "h:1"]).unwrap();
    let Some(Command::Client(client)) = cli.command else { panic!("not the client command") };
    assert_eq!(client.gpus, None, "host memory without --gpus");
}

fn positional_is_empty(cli: &Cli) -> bool {
    cli.positional.gpu_list.is_none() && cli.positional.nics_per_gpu.is_none()
}

#[test]
fn gpus_alone_is_the_gpu_report() {
    let cli = parse(&["--gpus"]).unwrap();
    assert!(cli.gpus.gpus && cli.command.is_none() && positional_is_empty(&cli));
    let cli = parse(&["--gpus", "--gpu-provider", "tcp,shm", "--gpu-json"]).unwrap();
    assert_eq!(cli.gpus.providers, vec!["tcp", "shm"]);
    assert!(cli.gpus.gpu_json);
}

#[test]
fn bad_gpu_lists_are_refused_clearly() {
    let err = |args: &[&str]| parse(args).err().unwrap_or_else(|| panic!("{args:?} parsed"));
    assert!(err(&["0,,1", "2"]).contains("entry 2 is empty"));
    assert!(err(&["x", "2"]).contains("'x' is not a GPU index"));
    assert!(err(&["0,1,0", "2"]).contains("GPU 0 is listed twice"));
    assert!(err(&["server", "--gpus", "0,,1"]).contains("entry 2 is empty"));
    assert!(err(&["client", "--gpus", "1,1", "--connect", "h:1"]).contains("GPU 1 is listed twice"));
    assert!(err(&["0", "0"]).contains("NICS_PER_GPU must be"));
    assert!(err(&["0", "many"]).contains("NICS_PER_GPU must be"));
}

#[test]
fn mixed_forms_are_refused_clearly() {
    let err = |args: &[&str]| parse(args).err().unwrap_or_else(|| panic!("{args:?} parsed"));
    assert!(err(&["--gpus", "0,1", "2"]).contains("'--gpus' cannot be used with '[GPUS]'"));
    let wrong_order = err(&["--gpus", "server"]);
    assert!(wrong_order.contains("'server' is a command") && wrong_order.contains("--gpus"), "{wrong_order}");
    assert!(err(&["0,1", "2", "server"]).contains("SERVER_ADDRESS must be HOST:PORT"));
    assert!(err(&["0,1", "2", "h:1", "extra"]).contains("cannot be used with"));
    assert!(positional(&["0,1"]).unwrap_err().contains("NICS_PER_GPU is missing"));
    assert!(positional(&["0", "2", "--domains", "2"]).unwrap_err().contains("leave out --domain"));
    assert!(positional(&["0", "2", "h:1", "--listen", "h:2"]).unwrap_err().contains("--listen is the server's"));
}
