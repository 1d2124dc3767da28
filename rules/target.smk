rule convert_target:
    input:
        gguf=(
            str(resolve_path(config["target"]["path"]))
            if config["target"]["path"].endswith(".gguf")
            else []
        ),
    output:
        directory("results/target"),
    log:
        "results/logs/convert_target.log",
    conda:
        "../envs/dflash.yaml"
    threads: 2
    resources:
        mem_mb=4000,
    script:
        "../workflow/scripts/convert_target.py"
