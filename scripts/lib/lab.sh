# The proxy lab of scripts/hop-latency.sh and scripts/cpu-split.sh (sourced, not run): a
# zero-think-time sim on 127.0.0.1:18001, the gateway on 18002 and, when installed, nginx on 18003
# with the proxy settings of `bench gateway` (crates/tokenway-bench/src/nginx.rs).
#
# lab_start BINARY DIR starts them, with logs and nginx's files under DIR, and sets `sim` (the
# sim's pid) and `targets`: "gateway:18002:PID" and, with nginx, "nginx:18003:nginx".
# lab_pids PID prints the processes serving a target (for "nginx", its workers).
# lab_stop stops nginx; the caller's own jobs (sim, gateway) end with `kill $(jobs -p)`.

lab_start() {
  local bin=$1 dir=$2
  local profile
  profile=$(dirname "${BASH_SOURCE[0]}")/../profile
  lab_dir=$dir
  "$bin" sim --listen 127.0.0.1:18001 --config "$profile/sim.toml" >"$dir/sim.log" 2>&1 &
  sim=$!
  "$bin" gateway --config "$profile/gateway.toml" >"$dir/gw.log" 2>&1 &
  targets="gateway:18002:$!"
  if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then
    mkdir -p "$dir/ng/tmp"
    cat > "$dir/ng/nginx.conf" <<EOT
daemon on;
worker_processes auto;
worker_rlimit_nofile 65536;
pid $dir/nginx.pid;
error_log $dir/ng/error.log warn;
events { worker_connections 16384; multi_accept on; }
http {
  access_log off;
  client_body_temp_path $dir/ng/tmp; proxy_temp_path $dir/ng/tmp; fastcgi_temp_path $dir/ng/tmp;
  uwsgi_temp_path $dir/ng/tmp; scgi_temp_path $dir/ng/tmp;
  keepalive_requests 1000000; keepalive_timeout 120s; tcp_nodelay on;
  upstream sim { server 127.0.0.1:18001; keepalive 256; keepalive_requests 1000000; keepalive_timeout 120s; }
  server {
    listen 127.0.0.1:18003 backlog=4096;
    location / {
      proxy_pass http://sim; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_request_buffering off; proxy_cache off;
    }
  }
}
EOT
    PATH=$PATH:/usr/sbin nginx -p "$dir/ng" -c "$dir/ng/nginx.conf"
    targets="$targets nginx:18003:nginx"
  fi
  for _ in $(seq 60); do grep -q "listening on" "$dir/gw.log" && break; sleep 0.5; done
  sleep 1
}

lab_pids() {
  if [ "$1" = nginx ]; then pgrep -P "$(cat "$lab_dir/nginx.pid")" | tr '\n' ' '; else echo "$1"; fi
}

lab_stop() {
  if [ -n "${lab_dir:-}" ] && [ -f "$lab_dir/nginx.pid" ]; then
    kill "$(cat "$lab_dir/nginx.pid")" 2>/dev/null || true
  fi
}
