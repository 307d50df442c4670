//! Launcher variables, their precedence and their errors; Slurm node lists.

use super::*;

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

fn env(pairs: &[(&str, &str)]) -> Result<Option<ClusterEnv>, EnvError> {
    ClusterEnv::from_vars(vars(pairs))
}

fn error(pairs: &[(&str, &str)]) -> String {
    env(pairs).unwrap_err().to_string()
}

fn cluster(rank: u32, world: u32, local_rank: u32, master: (&str, u16), source: LaunchSource) -> ClusterEnv {
    ClusterEnv { rank, world, local_rank, master_addr: master.0.into(), master_port: master.1, source }
}

const TORCHRUN: [(&str, &str); 5] =
    [("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node7"), ("MASTER_PORT", "1234")];
const SLURM: [(&str, &str); 4] =
    [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "6"), ("SLURM_LOCALID", "2"), ("SLURM_JOB_NODELIST", "gpu[03-05]")];
const OPEN_MPI: [(&str, &str); 3] =
    [("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_LOCAL_RANK", "0")];
const PMI: [(&str, &str); 3] = [("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("MPI_LOCALRANKID", "1")];

#[test]
fn no_launcher_variables_is_none() {
    assert_eq!(env(&[("MASTER_ADDR", "x"), ("LOCAL_RANK", "0"), ("PATH", "/bin")]), Ok(None));
}

#[test]
fn torchrun_variables_give_rank_world_and_master() {
    assert_eq!(env(&TORCHRUN), Ok(Some(cluster(3, 8, 1, ("node7", 1234), LaunchSource::Torchrun))));
    let defaults = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap().unwrap();
    assert_eq!(defaults, cluster(0, 2, 0, ("127.0.0.1", 29500), LaunchSource::Torchrun));
}

#[test]
fn slurm_master_is_the_first_host_of_the_node_list_unless_master_addr_is_set() {
    assert_eq!(env(&SLURM), Ok(Some(cluster(5, 6, 2, ("gpu03", 29500), LaunchSource::Slurm))));
    let step_first = [&SLURM[..], &[("SLURM_STEP_NODELIST", "a[7-8]"), ("MASTER_PORT", "4000")]].concat();
    assert_eq!(env(&step_first).unwrap().unwrap().master(), "a7:4000");
    let explicit = [&SLURM[..], &[("MASTER_ADDR", "login1")]].concat();
    assert_eq!(env(&explicit).unwrap().unwrap().master_addr, "login1");
    let nprocs = [("SLURM_PROCID", "0"), ("SLURM_NPROCS", "1")];
    assert_eq!(env(&nprocs), Ok(Some(cluster(0, 1, 0, ("127.0.0.1", 29500), LaunchSource::Slurm))));
}

#[test]
fn open_mpi_and_pmi_variables_use_the_default_master() {
    assert_eq!(env(&OPEN_MPI), Ok(Some(cluster(2, 4, 0, ("127.0.0.1", 29500), LaunchSource::OpenMpi))));
    assert_eq!(env(&PMI), Ok(Some(cluster(1, 2, 1, ("127.0.0.1", 29500), LaunchSource::Pmi))));
    let pmi_local = [("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("PMI_LOCAL_RANK", "1"), ("MASTER_ADDR", "h")];
    assert_eq!(env(&pmi_local), Ok(Some(cluster(1, 2, 1, ("h", 29500), LaunchSource::Pmi))));
    let pmi_bare = [("PMI_RANK", "1"), ("PMI_SIZE", "2")];
    assert_eq!(env(&pmi_bare).unwrap().unwrap().local_rank, 0);
}

#[test]
fn torchrun_wins_over_slurm_which_wins_over_open_mpi_which_wins_over_pmi() {
    let all = [&TORCHRUN[..], &SLURM[..], &OPEN_MPI[..], &PMI[..]].concat();
    assert_eq!(env(&all).unwrap().unwrap().source, LaunchSource::Torchrun);
    assert_eq!(env(&all[5..]).unwrap().unwrap().source, LaunchSource::Slurm);
    assert_eq!(env(&all[9..]).unwrap().unwrap().source, LaunchSource::OpenMpi);
    assert_eq!(env(&all[12..]).unwrap().unwrap().source, LaunchSource::Pmi);
}

#[test]
fn launcher_names_read_as_users_know_them() {
    let names: Vec<String> =
        [LaunchSource::Flags, LaunchSource::Torchrun, LaunchSource::Slurm, LaunchSource::OpenMpi, LaunchSource::Pmi]
            .iter()
            .map(ToString::to_string)
            .collect();
    assert_eq!(names, ["flags", "torchrun", "Slurm", "Open MPI", "PMI"]);
}

#[test]
fn bad_numbers_and_ranks_are_errors_naming_variable_and_value() {
    assert_eq!(error(&[("RANK", "one"), ("WORLD_SIZE", "2")]), "RANK='one' is not a number");
    assert_eq!(error(&[("RANK", "0"), ("WORLD_SIZE", "0")]), "WORLD_SIZE=0, but a job has at least one rank");
    assert_eq!(error(&[("RANK", "4"), ("WORLD_SIZE", "4")]), "RANK=4 is not below WORLD_SIZE=4 (ranks count from 0)");
    assert_eq!(
        error(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "2"), ("SLURM_NODELIST", "n1")]),
        "SLURM_LOCALID=2 is not below SLURM_NTASKS=2 (ranks count from 0)"
    );
    assert_eq!(error(&[("PMI_RANK", "-1"), ("PMI_SIZE", "2")]), "PMI_RANK='-1' is not a number");
}

#[test]
fn half_a_launchers_variables_is_an_error() {
    assert_eq!(error(&[("RANK", "0")]), "RANK is set but WORLD_SIZE is not; a launch by torchrun sets both");
    assert_eq!(error(&[("WORLD_SIZE", "2")]), "WORLD_SIZE is set but RANK is not; a launch by torchrun sets both");
    assert_eq!(
        error(&[("SLURM_NTASKS", "2")]),
        "SLURM_NTASKS is set but SLURM_PROCID is not; a launch by Slurm sets both"
    );
    assert_eq!(
        error(&[("OMPI_COMM_WORLD_RANK", "0")]),
        "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not; a launch by Open MPI sets both"
    );
}

#[test]
fn bad_masters_are_errors() {
    let with = |extra: (&str, &str)| error(&[("RANK", "0"), ("WORLD_SIZE", "2"), extra]);
    assert_eq!(with(("MASTER_PORT", "70000")), "MASTER_PORT='70000' is not a port (1 to 65535)");
    assert_eq!(with(("MASTER_PORT", "0")), "MASTER_PORT='0' is not a port (1 to 65535)");
    assert_eq!(with(("MASTER_PORT", "http")), "MASTER_PORT='http' is not a number");
    assert_eq!(with(("MASTER_ADDR", " ")), "MASTER_ADDR=' ' names no host; it must name rank 0's host");
    let slurm = error(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]);
    assert!(slurm.starts_with("a Slurm launch of 2 ranks sets no node list"), "{slurm}");
    let bad_list = error(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_NODELIST", "n[1-")]);
    assert_eq!(bad_list, "the Slurm node list 'n[1-' is malformed: the '[' at byte 1 is never closed");
}

#[test]
fn flags_give_rank_world_and_master() {
    assert_eq!(
        ClusterEnv::from_flags(1, 2, "node1:29501"),
        Ok(cluster(1, 2, 0, ("node1", 29501), LaunchSource::Flags))
    );
    let ipv6 = ClusterEnv::from_flags(0, 1, "[fe80::1]:7").unwrap();
    assert_eq!((ipv6.master_addr.as_str(), ipv6.master()), ("fe80::1", "[fe80::1]:7".to_string()));
    let error = |rank, world, master| ClusterEnv::from_flags(rank, world, master).unwrap_err().to_string();
    assert_eq!(error(2, 2, "a:1"), "--rank=2 is not below --world=2 (ranks count from 0)");
    assert_eq!(error(0, 0, "a:1"), "--world=0, but a job has at least one rank");
    assert_eq!(error(0, 1, "node1"), "--master='node1' has no port; write it as host:port, e.g. node1:29500");
    assert_eq!(error(0, 1, ":29500"), "--master=':29500' names no host; it must name rank 0's host");
    assert_eq!(error(0, 1, "a:99999"), "--master='a:99999' is not a port (1 to 65535)");
}

fn hosts(list: &str) -> Vec<String> {
    expand_nodelist(list).unwrap()
}

#[test]
fn node_lists_expand_in_order_keeping_zero_padding() {
    assert_eq!(hosts("node[1-3,7]"), ["node1", "node2", "node3", "node7"]);
    assert_eq!(hosts("gpu[01-03]"), ["gpu01", "gpu02", "gpu03"]);
    assert_eq!(hosts("n[8-10]"), ["n8", "n9", "n10"]);
    assert_eq!(hosts("a,b[1-2],c"), ["a", "b1", "b2", "c"]);
    assert_eq!(hosts("rack[1-2]-node[1-2]"), ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]);
    assert_eq!(hosts("single"), ["single"]);
    assert_eq!(hosts("x[5]y"), ["x5y"]);
}

#[test]
fn malformed_node_lists_are_errors_naming_the_list() {
    let error = |list: &str| expand_nodelist(list).unwrap_err().to_string();
    assert_eq!(error(""), "the Slurm node list '' is malformed: it is empty");
    assert_eq!(error("n]1["), "the Slurm node list 'n]1[' is malformed: the ']' at byte 1 closes no '['");
    assert_eq!(
        error("n[1-[2]]"),
        "the Slurm node list 'n[1-[2]]' is malformed: a '[' at byte 4 opens inside another bracket group"
    );
    assert_eq!(error("n[3-1]"), "the Slurm node list 'n[3-1]' is malformed: the range '3-1' in '[3-1]' runs backwards");
    assert_eq!(
        error("n[]"),
        "the Slurm node list 'n[]' is malformed: '' in '[]' is not a number or a range of numbers"
    );
    assert_eq!(
        error("n[a-b]"),
        "the Slurm node list 'n[a-b]' is malformed: 'a-b' in '[a-b]' is not a number or a range of numbers"
    );
    assert!(error("a,,b").contains("an empty host name"));
    assert!(error("a,").contains("an empty host name"));
}

#[test]
fn node_lists_past_the_cap_are_refused_before_expanding() {
    assert_eq!(hosts("n[1-65536]").len(), MAX_NODELIST_HOSTS);
    let too_many = expand_nodelist("n[1-65536],extra").unwrap_err();
    assert_eq!(too_many, EnvError::TooManyHosts { list: "n[1-65536],extra".into() });
    assert!(matches!(expand_nodelist("a[1-1000]b[1-1000]"), Err(EnvError::TooManyHosts { .. })));
    let huge = "n[0-18446744073709551615][0-18446744073709551615]";
    assert!(matches!(expand_nodelist(huge), Err(EnvError::TooManyHosts { .. })));
    assert!(expand_nodelist("n[0-99999999999999999999]").unwrap_err().to_string().contains("too large"));
}
