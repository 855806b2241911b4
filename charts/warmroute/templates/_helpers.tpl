{{/* Names, labels and the values several templates derive (feed URL, secret names, checks). */}}

{{- define "warmroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "warmroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "warmroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "warmroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: warmroute
{{- end -}}

{{/* Selector labels of one component: include "warmroute.selector" (list . "gateway") */}}
{{- define "warmroute.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "warmroute.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "warmroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "warmroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "warmroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The salt Secret's name and key; fails with the way to give one when neither is set. */}}
{{- define "warmroute.saltSecretName" -}}
{{- if .Values.salt.existingSecret -}}
{{- .Values.salt.existingSecret -}}
{{- else if .Values.salt.value -}}
{{- printf "%s-salt" (include "warmroute.fullname" .) -}}
{{- else -}}
{{- fail "\n\nsalt: no cache-salt secret given. Every gateway pod must derive the same per-tenant salt, so the chart never makes one up. Create a Secret once and name it:\n  kubectl create secret generic warmroute-salt --from-literal=secret=\"$(head -c 32 /dev/urandom | base64)\"\n  helm install ... --set salt.existingSecret=warmroute-salt\n(or pass the secret itself with --set salt.value=..., 32 characters or more)." -}}
{{- end -}}
{{- end -}}
{{- define "warmroute.saltSecretKey" -}}
{{- if .Values.salt.existingSecret -}}{{ .Values.salt.existingSecretKey }}{{- else -}}secret{{- end -}}
{{- end -}}

{{- define "warmroute.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "warmroute.fullname" .)) .Values.auth.apiKeys.existingSecret -}}
{{- end -}}
{{- define "warmroute.apiKeysSecretKey" -}}
{{- if .Values.auth.apiKeys.existingSecret -}}{{ .Values.auth.apiKeys.existingSecretKey }}{{- else -}}keys.yaml{{- end -}}
{{- end -}}
{{- define "warmroute.jwtSecretName" -}}
{{- default (printf "%s-jwt" (include "warmroute.fullname" .)) .Values.auth.jwt.existingSecret -}}
{{- end -}}

{{/* The Redis password Secret (name, key), or empty when the feed has no password. */}}
{{- define "warmroute.redisPasswordRef" -}}
{{- $r := .Values.feed.redis -}}
{{- if $r.enabled -}}
{{- if $r.auth.enabled -}}
{{- if $r.auth.existingSecret -}}
{{- dict "name" $r.auth.existingSecret "key" $r.auth.existingSecretKey | toJson -}}
{{- else if $r.auth.password -}}
{{- dict "name" (printf "%s-redis" (include "warmroute.fullname" .)) "key" "password" | toJson -}}
{{- else -}}
{{- fail "feed.redis.auth.enabled: give feed.redis.auth.existingSecret (a Secret with the password) or feed.redis.auth.password" -}}
{{- end -}}
{{- end -}}
{{- else if .Values.feed.externalPasswordSecret.name -}}
{{- dict "name" .Values.feed.externalPasswordSecret.name "key" .Values.feed.externalPasswordSecret.key | toJson -}}
{{- end -}}
{{- end -}}

{{/* The feed URL without credentials (what the ConfigMap shows). */}}
{{- define "warmroute.feedUrl" -}}
{{- if .Values.feed.redis.enabled -}}
{{- printf "redis://%s-redis:%d/0" (include "warmroute.fullname" .) (int .Values.feed.redis.port) -}}
{{- else if .Values.feed.externalUrl -}}
{{- .Values.feed.externalUrl -}}
{{- else -}}
{{- fail "feed: set feed.redis.enabled=true (a Redis in the release) or feed.externalUrl (redis://HOST:PORT/DB)" -}}
{{- end -}}
{{- end -}}

{{/* Env entries giving FEED_URL (with the password when there is one; kubelet expands $(VAR)). */}}
{{- define "warmroute.feedEnv" -}}
{{- $ref := include "warmroute.redisPasswordRef" . -}}
{{- $url := include "warmroute.feedUrl" . -}}
{{- if $ref -}}
{{- $r := fromJson $ref -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $r.name | quote }}, key: {{ $r.key | quote }}}
- name: FEED_URL
  value: {{ regexReplaceAll "^(rediss?://)" $url "${1}:$(REDIS_PASSWORD)@" | quote }}
{{- else -}}
- name: FEED_URL
  value: {{ $url | quote }}
{{- end -}}
{{- end -}}

{{/* The served model name the gateway and the agents key on ("" when discovered). */}}
{{- define "warmroute.modelName" -}}
{{- if eq .Values.replicas.mode "deploy" -}}
{{- $d := .Values.replicas.deploy -}}
{{- if and $d.servedModelName .Values.config.model.name (ne $d.servedModelName .Values.config.model.name) -}}
{{- fail "replicas.deploy.servedModelName and config.model.name differ: set one (the gateway serves the name the engines serve)" -}}
{{- end -}}
{{- default (default $d.model .Values.config.model.name) $d.servedModelName -}}
{{- else -}}
{{- .Values.config.model.name -}}
{{- end -}}
{{- end -}}

{{/* "true" when the gateway sends vLLM request priorities (flow.engine_priority, keep-alive's engine_priority
as rendered): the engines must then run --scheduling-policy priority, or they refuse every request with a
priority other than 0 (400 "Priority scheduling is not enabled"). */}}
{{- define "warmroute.enginePriority" -}}
{{- $c := .Values.config -}}
{{- $ka := include "warmroute.keepAlive" . | fromJson -}}
{{- if or (and $c.flow $c.flow.engine_priority) $ka.engine_priority -}}true{{- end -}}
{{- end -}}

{{/* What the deployed engines' extraArgs say about rendering chats, as config.model fields (JSON):
--chat-template (inline; a file's path as "chat_template_file", which the gateway's pod cannot read),
--chat-template-content-format, --default-chat-template-kwargs, --[no-]interleave-mm-strings; each as
"--flag value" or "--flag=value". The gateway must render as the engines do. */}}
{{- define "warmroute.engineChatArgs" -}}
{{- $out := dict -}}
{{- if eq .Values.replicas.mode "deploy" -}}
{{- $args := .Values.replicas.deploy.extraArgs -}}
{{- range $i, $a := $args -}}
{{- $a = toString $a -}}
{{- $name := $a -}}{{- $val := "" -}}
{{- if and (hasPrefix "--" $a) (contains "=" $a) -}}
{{- $kv := splitn "=" 2 $a -}}{{- $name = $kv._0 -}}{{- $val = $kv._1 -}}
{{- else if lt (add1 $i) (len $args) -}}
{{- $val = toString (index $args (add1 $i)) -}}
{{- end -}}
{{- if eq $name "--chat-template-content-format" -}}
{{- $_ := set $out "chat_template_content_format" $val -}}
{{- else if eq $name "--default-chat-template-kwargs" -}}
{{- $kw := fromJson $val -}}
{{- if hasKey $kw "Error" -}}{{- fail (printf "replicas.deploy.extraArgs: --default-chat-template-kwargs must be a JSON object, got %q" $val) -}}{{- end -}}
{{- $_ := set $out "default_chat_template_kwargs" $kw -}}
{{- else if eq $name "--chat-template" -}}
{{- if or (contains "{%" $val) (contains "{{" $val) -}}
{{- $_ := set $out "chat_template" $val -}}
{{- else -}}
{{- $_ := set $out "chat_template_file" $val -}}
{{- end -}}
{{- else if eq $name "--interleave-mm-strings" -}}
{{- $_ := set $out "interleave_mm_strings" (ne $val "false") -}}
{{- else if eq $name "--no-interleave-mm-strings" -}}
{{- $_ := set $out "interleave_mm_strings" false -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* config.keep_alive as the gateway gets it (JSON): in deploy mode, whose engines the chart runs with
--scheduling-policy priority, keep-alive's refreshes go ahead of the queue (engine_priority true) and may
then go to a replica with a queue (max_waiting 8), unless set. */}}
{{- define "warmroute.keepAlive" -}}
{{- $ka := deepCopy (default (dict) .Values.config.keep_alive) -}}
{{- if and $ka.enabled (eq .Values.replicas.mode "deploy") (not (hasKey $ka "engine_priority")) -}}
{{- $_ := set $ka "engine_priority" true -}}
{{- if not (hasKey $ka "max_waiting") }}{{ $_ := set $ka "max_waiting" 8 }}{{ end -}}
{{- end -}}
{{- toJson $ka -}}
{{- end -}}

{{/* The gateway's tokenizer source after defaults: builtin | hub | volume, and the hub model. */}}
{{- define "warmroute.tokenizerHubModel" -}}
{{- default (ternary .Values.replicas.deploy.model "" (eq .Values.replicas.mode "deploy")) .Values.gateway.tokenizer.hubModel -}}
{{- end -}}

{{/* The agent container (sidecar in deploy mode, own pod in attach mode):
     include "warmroute.agentContainer" (dict "root" $ "replicaId" ID "engineUrl" URL "events" EP "replay" EP
     "startupSeconds" S) */}}
{{- define "warmroute.agentContainer" -}}
{{- $ := .root -}}
{{- $model := include "warmroute.modelName" $ -}}
- name: agent
  image: {{ include "warmroute.image" $ | quote }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  args:
    - agent
    - --replica-id
    - {{ .replicaId | quote }}
    - --engine-url
    - {{ .engineUrl | quote }}
    - --kv-events-endpoint
    - {{ .events | quote }}
    {{- if .replay }}
    - --replay-endpoint
    - {{ .replay | quote }}
    {{- end }}
    - --feed
    - $(FEED_URL)
    {{- if $model }}
    - --model
    - {{ $model | quote }}
    {{- end }}
    - --block-size
    - {{ $.Values.config.model.block_size | quote }}
    - --load-interval
    - {{ $.Values.agent.loadIntervalSeconds | quote }}
    - --snapshot-interval
    - {{ $.Values.agent.snapshotIntervalSeconds | quote }}
    - --admin-host
    - "0.0.0.0"
    - --admin-port
    - {{ $.Values.agent.adminPort | quote }}
  env:
    - name: POD_IP
      valueFrom:
        fieldRef: {fieldPath: status.podIP}
    {{- include "warmroute.feedEnv" $ | nindent 4 }}
  ports:
    - {name: agent-metrics, containerPort: {{ $.Values.agent.adminPort }}, protocol: TCP}
  # The agent opens its admin port once it knows the model and has published its first state
  # (after the engine answers): a startup probe covers that wait. No readiness probe: a sidecar's
  # readiness would take the engine out of the headless Service with it.
  startupProbe:
    httpGet: {path: /healthz, port: agent-metrics}
    periodSeconds: 5
    failureThreshold: {{ div (int .startupSeconds) 5 | max 1 }}
  livenessProbe:
    httpGet: {path: /healthz, port: agent-metrics}
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml $.Values.agent.resources | nindent 4 }}
  securityContext:
    {{- toYaml $.Values.gateway.securityContext | nindent 4 }}
    runAsNonRoot: true
    runAsUser: {{ $.Values.gateway.podSecurityContext.runAsUser | default 10001 }}
{{- end -}}

{{/* The JWT key files the gateway gets, as a JSON list of Secret keys. */}}
{{- define "warmroute.jwtKeys" -}}
{{- $j := .Values.auth.jwt -}}
{{- if $j.existingSecret -}}
{{- if not $j.existingSecretKeys -}}
{{- fail "auth.jwt.existingSecretKeys: name the keys the JWT Secret holds (hs256.secret, public.pem, jwks.json)" -}}
{{- end -}}
{{- toJson $j.existingSecretKeys -}}
{{- else -}}
{{- $k := list -}}
{{- if $j.hs256Secret }}{{ $k = append $k "hs256.secret" }}{{ end -}}
{{- if $j.rs256PublicKeyPem }}{{ $k = append $k "public.pem" }}{{ end -}}
{{- if $j.jwks }}{{ $k = append $k "jwks.json" }}{{ end -}}
{{- if not $k -}}
{{- fail "auth.jwt.enabled: give auth.jwt.existingSecret (with existingSecretKeys) or one of auth.jwt.hs256Secret, rs256PublicKeyPem, jwks" -}}
{{- end -}}
{{- toJson $k -}}
{{- end -}}
{{- end -}}

{{/* The router: the HTTP gateway, or in epp mode (epp.enabled) the Endpoint Picker that a
     Gateway API gateway in front (Envoy) asks. Its component label and its Deployment/Service name. */}}
{{- define "warmroute.routerComponent" -}}
{{- ternary "epp" "gateway" (.Values.epp.enabled | default false) -}}
{{- end -}}
{{- define "warmroute.routerName" -}}
{{- if .Values.epp.enabled -}}
{{- printf "%s-epp" (include "warmroute.fullname" . | trunc 59 | trimSuffix "-") -}}
{{- else -}}
{{- include "warmroute.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "warmroute.inferencePoolName" -}}
{{- default (include "warmroute.fullname" .) .Values.epp.inferencePool.name -}}
{{- end -}}

{{/* The vLLM pods the InferencePool selects, as JSON matchLabels: the chart's own StatefulSet
     pods (deploy mode), or the labels in values (attach mode). */}}
{{- define "warmroute.inferencePoolLabels" -}}
{{- if eq .Values.replicas.mode "deploy" -}}
{{- include "warmroute.selector" (list . "vllm") | fromYaml | toJson -}}
{{- else -}}
{{- $l := .Values.epp.inferencePool.matchLabels | default (default (dict) .Values.replicas.attach.podSelector).matchLabels -}}
{{- if not $l -}}
{{- fail "epp.inferencePool.matchLabels: in attach mode, give the labels of your vLLM pods (the InferencePool selects them; or set replicas.attach.podSelector.matchLabels)" -}}
{{- end -}}
{{- toJson $l -}}
{{- end -}}
{{- end -}}

{{/* The engine port of the replicas (the InferencePool's targetPorts, the picker's DNS port). */}}
{{- define "warmroute.enginePort" -}}
{{- ternary .Values.replicas.deploy.port .Values.replicas.attach.port (eq .Values.replicas.mode "deploy") | int -}}
{{- end -}}

{{/* epp mode: the values that cannot work together, each refused naming what to set. */}}
{{- define "warmroute.eppChecks" -}}
{{- $e := .Values.epp -}}
{{- $port := include "warmroute.enginePort" . -}}
{{- if or (eq (int $e.ports.grpc) (int $e.ports.grpcHealth)) (eq (int $e.ports.grpc) (int .Values.gateway.ports.admin)) (eq (int $e.ports.grpcHealth) (int .Values.gateway.ports.admin)) -}}
{{- fail "epp.ports: grpc, grpcHealth and gateway.ports.admin must be three different ports" -}}
{{- end -}}
{{- if and (eq .Values.replicas.mode "attach") .Values.replicas.attach.endpoints -}}
{{- range .Values.replicas.attach.endpoints -}}
{{- $host := (urlParse .url).host -}}
{{- if not (regexMatch "^([0-9]{1,3}(\\.[0-9]{1,3}){3}|\\[[0-9a-fA-F:.]+\\])(:[0-9]+)?$" $host) -}}
{{- fail (printf "epp.enabled: replicas.attach.endpoints %s: url %s must name the pod by IP (the picker names replicas host:port, and Envoy's endpoints are pod IPs); or name their headless Service in replicas.attach.headlessService" .id .url) -}}
{{- end -}}
{{- if ne (regexFind ":[0-9]+$" $host) (printf ":%s" $port) -}}
{{- fail (printf "epp.enabled: replicas.attach.endpoints %s: url %s must use port replicas.attach.port (%s), the InferencePool's target port" .id .url $port) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not $e.gatewayFrom) -}}
{{- fail "epp.gatewayFrom: name the pods of the Gateway in front (NetworkPolicy peers, e.g. [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: gateway-system}}}]): its Envoy calls the picker and sends the requests to the engines; or set networkPolicy.enabled=false" -}}
{{- end -}}
{{- if and (eq $e.failureMode "FailOpen") .Values.auth.enabled (not $e.trustedTenantHeader) -}}
{{- fail "epp.failureMode: FailOpen with the picker authenticating (auth.enabled, no epp.trustedTenantHeader) would send requests to the engines unauthenticated and unsalted whenever the picker is down; use FailClose, or let the gateway in front authenticate (epp.trustedTenantHeader)" -}}
{{- end -}}
{{- if and $e.httpRoute.enabled (not $e.httpRoute.parentRefs) -}}
{{- fail "epp.httpRoute.parentRefs: name the Gateway the HTTPRoute attaches to (e.g. [{name: inference-gateway, namespace: gateway-system}]), or set epp.httpRoute.enabled=false" -}}
{{- end -}}
{{- $_ := include "warmroute.inferencePoolLabels" . -}}
{{- end -}}
