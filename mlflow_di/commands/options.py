"""Options several subcommands share, defined once so their names and help stay the same."""
import click

preprocessing_option = click.option(
    "--preprocessing", default=None, metavar="KEY=VALUE,...",
    help="Override the model's stored preprocessing, e.g. 'scale=1,layout=NHWC,input_shape=28/28/1'.")
json_out_option = click.option(
    "--json-out", type=click.Path(dir_okay=False), default=None, help="Also write the results to this JSON file.")
seed_option = click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random choice.")
